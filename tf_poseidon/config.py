"""The strategy's options: validated once, immutable afterwards."""

from __future__ import annotations

import dataclasses

from tf_poseidon.algorithms import Algorithm, from_mode
from tf_poseidon.comm import codecs
from tf_poseidon.comm.codecs import Codec
from tf_poseidon.lowrank import PowerSGD

SFB_CHOICES = ("auto", "always", "never")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, init=False)
class StrategyConfig:
    """Validated arguments of :class:`tf_poseidon.PoseidonStrategy` (see its docstring).

    ``algorithm`` is an Algorithm object; the keyword form (``mode="ssp", staleness=2``) builds
    one through the registry (algorithms/registry.py). ``codec`` is the Codec that
    ``compression`` names (or the instance given). ``lowrank`` is a PowerSGD or None (a dict
    of PowerSGD's keyword arguments is accepted for it, as from a configuration file). Raises
    ValueError naming a wrong argument and what is allowed.
    """

    algorithm: Algorithm
    codec: Codec
    sfb: str
    bucket_bytes: int | None
    overlap: bool
    timeline: str | None
    bandwidth_gbps: float | None
    sync_batchnorm: bool
    lowrank: PowerSGD | None
    autotune: bool

    def __init__(self, algorithm: Algorithm | str | None = None, *, mode: str | None = None,
                 compression: str | Codec = "none", sfb: str = "auto",
                 bucket_bytes: int | None = None, overlap: bool = True,
                 timeline: str | None = None, bandwidth_gbps: float | None = None,
                 sync_batchnorm: bool = False, lowrank: PowerSGD | dict | None = None,
                 autotune: bool = True, **algorithm_options):
        from tf_poseidon import world
        if isinstance(algorithm, str):
            algorithm, mode = None, _one_mode(algorithm, mode)
        if algorithm is None:
            algorithm = from_mode(mode or "sync", **algorithm_options)
        elif not isinstance(algorithm, Algorithm):
            raise ValueError(f"PoseidonStrategy: algorithm={algorithm!r} is not valid; pass a "
                             "tf_poseidon.algorithms.Algorithm (e.g. tp.algorithms.SSP("
                             "staleness=2)) or a mode name.")
        elif mode is not None or algorithm_options:
            given = ", ".join([f"mode={mode!r}"] * (mode is not None)
                              + [f"{k}={v!r}" for k, v in algorithm_options.items()])
            raise ValueError(f"PoseidonStrategy: pass either algorithm={algorithm!r} or the "
                             f"keyword form ({given}), not both: the algorithm object holds "
                             "its own options.")
        algorithm.validate(world.size())
        if sfb not in SFB_CHOICES:
            raise ValueError(f"PoseidonStrategy: sfb={sfb!r} is not valid; allowed values are "
                             + ", ".join(repr(a) for a in SFB_CHOICES) + ".")
        if bucket_bytes is not None and (not _is_int(bucket_bytes) or bucket_bytes < 1):
            raise ValueError(f"PoseidonStrategy: bucket_bytes={bucket_bytes!r} is not "
                             "valid; it must be None (the default) or a positive integer.")
        if timeline is not None and (not isinstance(timeline, str) or not timeline):
            raise ValueError(f"PoseidonStrategy: timeline={timeline!r} is not valid; it "
                             "must be None or the path of the Chrome-trace JSON file to write.")
        if not isinstance(overlap, bool):
            raise ValueError(f"PoseidonStrategy: overlap={overlap!r} is not valid; "
                             "allowed values are True and False.")
        if bandwidth_gbps is not None and (
                isinstance(bandwidth_gbps, bool)
                or not isinstance(bandwidth_gbps, (int, float))
                or not 0.0 < bandwidth_gbps < float("inf")):
            raise ValueError(f"PoseidonStrategy: bandwidth_gbps={bandwidth_gbps!r} is not "
                             "valid; it must be None (measure it) or a positive number of "
                             "Gbit/s per rank.")
        if not isinstance(sync_batchnorm, bool):
            raise ValueError(f"PoseidonStrategy: sync_batchnorm={sync_batchnorm!r} is not "
                             "valid; allowed values are True and False.")
        if sync_batchnorm and not algorithm.lockstep:
            raise ValueError(f"PoseidonStrategy: sync_batchnorm=True needs an algorithm whose "
                             f"ranks step together (mode='sync'); {algorithm!r} lets ranks run "
                             "ahead of each other, and global batch statistics would make "
                             "every step wait for the slowest rank.")
        if not isinstance(autotune, bool):
            raise ValueError(f"PoseidonStrategy: autotune={autotune!r} is not valid; allowed "
                             "values are True and False.")
        lowrank = _lowrank(lowrank, algorithm)
        values = dict(algorithm=algorithm, codec=codecs.get(compression), sfb=sfb,
                      bucket_bytes=bucket_bytes, overlap=overlap, timeline=timeline,
                      bandwidth_gbps=bandwidth_gbps, sync_batchnorm=sync_batchnorm,
                      lowrank=lowrank, autotune=autotune)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def mode(self) -> str:
        """The algorithm's registered name ("sync", "ssp", "easgd", ...)."""
        return self.algorithm.name

    @property
    def compression(self) -> str:
        """The codec's name ("none", "fp16", "bf16", ...)."""
        return self.codec.name


def _lowrank(value: PowerSGD | dict | None, algorithm: Algorithm) -> PowerSGD | None:
    if isinstance(value, dict):
        unknown = set(value) - set(PowerSGD().options())
        if unknown:
            raise ValueError(f"PoseidonStrategy: lowrank={value!r} has unknown options "
                             f"{sorted(unknown)}; PowerSGD takes "
                             + ", ".join(PowerSGD().options()) + ".")
        value = PowerSGD(**value)
    if value is not None and not isinstance(value, PowerSGD):
        raise ValueError(f"PoseidonStrategy: lowrank={value!r} is not valid; pass None (the "
                         "default) or tp.PowerSGD(rank=..., start_step=..., "
                         "min_compression=...).")
    if value is not None and not algorithm.plans:
        raise ValueError(f"PoseidonStrategy: lowrank={value!r} compresses the gradients that "
                         f"mode='sync' sums each step; {algorithm!r} does not sum gradients "
                         "that way (it makes no per-layer plan). Use mode='sync' or leave "
                         "lowrank=None.")
    return value


def _one_mode(named: str, mode: str | None) -> str:
    if mode is not None and mode != named:
        raise ValueError(f"PoseidonStrategy: algorithm={named!r} and mode={mode!r} disagree; "
                         "give one of them.")
    return named
