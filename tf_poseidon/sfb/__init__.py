"""SFB: sufficient factor broadcasting for Dense layers (Poseidon).

For a Dense kernel W (M×N) and local batch K, rank p's gradient is ΔW_p = U_pᵀV_p, with U_p the
layer's input x_p [K, M] and V_p the gradient at its output δ_p [K, N]; instead of all-reducing
M·N numbers, the ranks can all-gather the factors (K·(M+N) numbers each) and rebuild
ΣΔW_p = UᵀV. Where that pays is the per-layer plan's call (tf_poseidon/sacp/).

This package is the one protocol: how factors are captured, sent and rebuilt. Which layers use
it is decided in sacp/, the planner of every protocol (all-reduce, SFB, sparse rows, low-rank),
because that choice compares SFB with the others and so belongs to none of them; sacp/'s cost
model holds SFB's bytes and time beside theirs.

* ``capture.py`` — while the replica function is traced, Dense layers record (U, V) against the
  local kernel gradient they return; no change to the user's model.
* ``protocol.py`` — the "sfb" bucket protocol: wire format, gathering, reconstruction.

algorithms/sync.py puts the pieces together; docs/sfb.md has the details and figures.
"""
