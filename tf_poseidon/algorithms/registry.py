"""The algorithm registry: ``mode=`` names to Algorithm classes, and the keyword form.

``PoseidonStrategy(algorithm=tp.algorithms.SSP(staleness=2))`` passes an algorithm object;
``PoseidonStrategy(mode="ssp", staleness=2)`` is the same through :func:`from_mode`, which finds
the class registered under the name and gives it the knobs. A knob that belongs to another
registered algorithm is checked by that algorithm (so a wrong value gets its message); then,
as the keyword form always did, it is accepted and ignored — silently at the value the keyword
form had as its default (:data:`FORMER_DEFAULTS`: scripts pass every knob whatever the mode),
with a warning naming its mode otherwise — except ``staleness`` > 0, which asks for SSP and is
refused outside ``mode="ssp"``.
"""

from __future__ import annotations

import inspect
import warnings

from tf_poseidon.algorithms.base import Algorithm
from tf_poseidon.registry import Registry

_REGISTRY: Registry[type[Algorithm]] = Registry(
    "algorithm", lambda cls: isinstance(cls, type) and issubclass(cls, Algorithm),
    "an Algorithm subclass")

FORMER_DEFAULTS = {"staleness": 0, "tau": 1, "alpha": 0.5, "easgd_async": False}
"""Knob values ``PoseidonStrategy``'s keyword form passed for every mode before algorithms
were objects; accepted with any mode, and ignored by the modes they do not belong to."""


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Registers ``cls`` under ``cls.name`` (usable as a class decorator); returns it.

    Raises ValueError if the name is empty or taken by another class.
    """
    return _REGISTRY.register(cls)


def names() -> tuple[str, ...]:
    """The registered ``mode=`` names, built-in ones first."""
    return _REGISTRY.names()


def knobs(cls: type[Algorithm]) -> tuple[str, ...]:
    """The keyword arguments ``cls`` takes."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return tuple(p.name for p in parameters
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def from_mode(mode: str, **options) -> Algorithm:
    """The algorithm ``mode`` names, built with ``options`` (its knobs).

    Raises ValueError for an unknown mode (naming the registered ones), an unknown knob, an
    invalid knob value (the algorithm's own message), or staleness > 0 outside mode="ssp";
    warns of another mode's knob, which it ignores.
    """
    cls = _REGISTRY.get(mode)
    if cls is None:
        raise ValueError(f"PoseidonStrategy: mode={mode!r} is not valid; allowed values are "
                         + ", ".join(repr(n) for n in names()) + ".")
    own = {k: v for k, v in options.items() if k in knobs(cls)}
    for name, value in options.items():
        if name in own:
            continue
        owner = next((other for other in _REGISTRY.entries() if name in knobs(other)), None)
        if owner is None:
            raise ValueError(f"PoseidonStrategy: unknown argument {name}={value!r}; the "
                             f"options of mode={mode!r} are "
                             + (", ".join(knobs(cls)) or "none") + ".")
        owner(**{name: value})  # its own checks and message for a wrong value
        if FORMER_DEFAULTS.get(name, object()) == value and type(value) is \
                type(FORMER_DEFAULTS[name]):
            continue
        if name == "staleness":
            raise ValueError(f"PoseidonStrategy: staleness={value!r} needs mode='ssp' "
                             f"(mode is {mode!r}).")
        warnings.warn(f"PoseidonStrategy: {name}={value!r} is an option of "
                      f"mode={owner.name!r}; mode={mode!r} ignores it.", UserWarning,
                      stacklevel=3)
    return cls(**own)
