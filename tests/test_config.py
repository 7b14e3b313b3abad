"""PoseidonStrategy's arguments: defaults, invalid values, features not there yet."""

import pytest

import tf_poseidon as tp
from tf_poseidon.config import StrategyConfig


def test_defaults_make_a_one_replica_sync_strategy():
    strategy = tp.PoseidonStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert strategy.config == StrategyConfig()
    assert strategy.config.mode == "sync" and strategy.config.overlap is True


@pytest.mark.parametrize("kwargs, names", [
    (dict(mode="async"), ["mode", "'sync'", "'ssp'", "'easgd'"]),
    (dict(compression="int8"), ["compression", "'none'", "'fp16'", "'bf16'"]),
    (dict(sfb="sometimes"), ["sfb", "'auto'", "'always'", "'never'"]),
    (dict(staleness=-1), ["staleness", ">= 0"]),
    (dict(staleness=1.5), ["staleness"]),
    (dict(staleness=2), ["staleness", "mode='ssp'"]),
    (dict(tau=0), ["tau", ">= 1"]),
    (dict(alpha=0.0), ["alpha", "(0, 1]"]),
    (dict(alpha=1.5), ["alpha", "(0, 1]"]),
    (dict(easgd_async="yes"), ["easgd_async", "True and False"]),
    (dict(bucket_bytes=0), ["bucket_bytes", "positive integer"]),
    (dict(bucket_bytes=2.5), ["bucket_bytes"]),
    (dict(overlap=None), ["overlap", "True and False"]),
])
def test_invalid_values_name_the_argument_and_the_allowed_values(kwargs, names):
    with pytest.raises(ValueError) as error:
        tp.PoseidonStrategy(**kwargs)
    for name in names:
        assert name in str(error.value)
