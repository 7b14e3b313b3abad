"""The strategy's options: validated once, immutable afterwards."""

from __future__ import annotations

import dataclasses

MODES = ("sync", "ssp", "easgd")
COMPRESSIONS = ("none", "fp16", "bf16")
SFB_CHOICES = ("auto", "always", "never")

# Features that later work adds; until then asking for them raises NotImplementedError.
_NOT_YET: dict[tuple[str, str], str] = {}


def _choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"PoseidonStrategy: {name}={value!r} is not valid; allowed values are "
                         + ", ".join(repr(a) for a in allowed) + ".")
    if (name, value) in _NOT_YET:
        raise NotImplementedError(f"PoseidonStrategy: {_NOT_YET[(name, value)]} is not "
                                  "implemented yet in this version of tf_poseidon.")
    return value


def _check_easgd_sync_alpha(alpha: float) -> None:
    """Synchronous EASGD moves the center by α·P times the ranks' mean distance from it each
    period: α·P must be < 1 (Zhang et al.'s β = α·P), or it overshoots and oscillates."""
    from tf_poseidon import world
    size = world.size()
    if size > 1 and alpha * size >= 1.0:
        raise ValueError(
            f"PoseidonStrategy: alpha={alpha!r} is not valid for synchronous EASGD on {size} "
            f"ranks: alpha·P = {alpha * size:g}, and it must be < 1 (each period the center "
            "moves by alpha·P times the ranks' mean distance from it; at 1 or more it jumps "
            f"to or past their mean and oscillates). Use alpha < 1/{size}, e.g. "
            f"alpha={0.9 / size:.3g} (alpha·P = 0.9, as Zhang et al.), or easgd_async=True.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """Validated arguments of :class:`tf_poseidon.PoseidonStrategy` (see its docstring)."""

    mode: str = "sync"
    compression: str = "none"
    sfb: str = "auto"
    staleness: int = 0
    tau: int = 1
    alpha: float = 0.5
    easgd_async: bool = False
    bucket_bytes: int | None = None
    overlap: bool = True
    timeline: str | None = None
    bandwidth_gbps: float | None = None

    def __post_init__(self):
        _choice("mode", self.mode, MODES)
        _choice("compression", self.compression, COMPRESSIONS)
        _choice("sfb", self.sfb, SFB_CHOICES)
        if not _is_int(self.staleness) or self.staleness < 0:
            raise ValueError(f"PoseidonStrategy: staleness={self.staleness!r} is not valid; "
                             "it must be an integer >= 0 (0 = synchronous).")
        if self.staleness > 0 and self.mode != "ssp":
            raise ValueError(f"PoseidonStrategy: staleness={self.staleness} needs mode='ssp' "
                             f"(mode is {self.mode!r}).")
        if not _is_int(self.tau) or self.tau < 1:
            raise ValueError(f"PoseidonStrategy: tau={self.tau!r} is not valid; the EASGD "
                             "period must be an integer >= 1 (steps between elastic moves).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"PoseidonStrategy: alpha={self.alpha!r} is not valid; the EASGD "
                             "moving rate must be a number in (0, 1].")
        if self.mode == "easgd" and self.easgd_async is False:
            _check_easgd_sync_alpha(self.alpha)
        if not isinstance(self.easgd_async, bool):
            raise ValueError(f"PoseidonStrategy: easgd_async={self.easgd_async!r} is not "
                             "valid; allowed values are True and False.")
        if self.bucket_bytes is not None and (not _is_int(self.bucket_bytes)
                                              or self.bucket_bytes < 1):
            raise ValueError(f"PoseidonStrategy: bucket_bytes={self.bucket_bytes!r} is not "
                             "valid; it must be None (the default) or a positive integer.")
        if self.timeline is not None and (not isinstance(self.timeline, str)
                                          or not self.timeline):
            raise ValueError(f"PoseidonStrategy: timeline={self.timeline!r} is not valid; it "
                             "must be None or the path of the Chrome-trace JSON file to write.")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"PoseidonStrategy: overlap={self.overlap!r} is not valid; "
                             "allowed values are True and False.")
        if self.bandwidth_gbps is not None and (
                isinstance(self.bandwidth_gbps, bool)
                or not isinstance(self.bandwidth_gbps, (int, float))
                or not 0.0 < self.bandwidth_gbps < float("inf")):
            raise ValueError(f"PoseidonStrategy: bandwidth_gbps={self.bandwidth_gbps!r} is not "
                             "valid; it must be None (measure it) or a positive number of "
                             "Gbit/s per rank.")
