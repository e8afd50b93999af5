"""The accounting functions take keyword arguments only (issue 11 item 15).

σ, q, δ and ε are floats of similar size: passed by position in the wrong order they would give
a wrong ε without any error. Each public function (and `PrivacyAccountant.step`) refuses a
positional call with a TypeError that names it and shows the keyword call, and its keyword call
gives what the accountant gives.
"""

import inspect
import math
import sys

import pytest

from tf_dp import accounting

DELTA = 1e-5
RUN = dict(noise_multiplier=1.0, sampling_probability=0.01, steps=100)

# Each function with a valid keyword call, in the functions' shared order: mechanism (σ, q),
# length, privacy parameter (ε or δ), then the optional ones.
CALLS = {
    "compute_epsilon": dict(**RUN, delta=DELTA),
    "compute_delta": dict(**RUN, epsilon=1.0),
    "calibrate_noise_multiplier": dict(
        sampling_probability=0.01, steps=100, target_epsilon=1.0, delta=DELTA
    ),
    "compute_max_steps": dict(
        noise_multiplier=1.0, sampling_probability=0.01, target_epsilon=1.0, delta=DELTA
    ),
    "compute_rdp_epsilon": dict(**RUN, delta=DELTA),
    "compute_gdp_mu": dict(**RUN),
    "gdp_delta": dict(mu=1.0, epsilon=1.0),
    "gdp_epsilon": dict(mu=1.0, delta=DELTA),
}

# One naming for the same quantity everywhere (STYLE.md: the papers' words).
NAMES = {
    "noise_multiplier", "sampling_probability", "steps", "delta", "epsilon", "target_epsilon",
    "num_projections", "mu", "relative_tolerance", "max_steps",
}


def _accountant(num_projections=None, **run):
    return accounting.PrivacyAccountant().step(
        noise_multiplier=run["noise_multiplier"],
        sampling_probability=run["sampling_probability"],
        num_projections=num_projections,
        count=run["steps"],
    )


@pytest.mark.parametrize("name", sorted(CALLS))
def test_positional_call_names_the_function_and_the_keywords(name):
    fn = getattr(accounting, name)
    kwargs = CALLS[name]
    keyword_call = ", ".join(f"{k}=..." for k in kwargs)
    message = rf"tf_dp\.accounting\.{name} takes keyword arguments only .*: {name}\({keyword_call}"
    with pytest.raises(TypeError, match=message):
        fn(*kwargs.values())
    first, *rest = kwargs  # one positional argument is refused too
    with pytest.raises(TypeError, match=message):
        fn(kwargs[first], **{k: kwargs[k] for k in rest})


@pytest.mark.parametrize("name", sorted(CALLS))
def test_signature_is_keyword_only_with_one_naming(name):
    params = inspect.signature(getattr(accounting, name)).parameters.values()
    assert all(p.kind == p.KEYWORD_ONLY for p in params)
    assert {p.name for p in params} <= NAMES
    assert [p.name for p in params if p.default is p.empty] == list(CALLS[name])


def test_missing_keyword_names_the_function():
    with pytest.raises(TypeError, match=r"compute_epsilon\(\) missing 1 required .*'delta'"):
        accounting.compute_epsilon(**RUN)


def test_accountant_step_is_keyword_only():
    acc = accounting.PrivacyAccountant()
    message = (r"tf_dp\.accounting\.PrivacyAccountant\.step takes keyword arguments only .*: "
               r"step\(noise_multiplier=\.\.\., sampling_probability=\.\.\., "
               r"num_projections=None, count=1\)")
    with pytest.raises(TypeError, match=message):
        acc.step(1.0, 0.01)
    with pytest.raises(TypeError, match=message):
        acc.step(1.0, sampling_probability=0.01)
    assert acc.steps == 0  # nothing recorded by the refused calls
    acc.step(noise_multiplier=1.0, sampling_probability=0.01, count=3)
    accounting.PrivacyAccountant.step(acc, noise_multiplier=1.0, sampling_probability=0.01)
    assert acc.steps == 4


@pytest.mark.parametrize("num_projections", [None, 20])
def test_keyword_calls_match_the_accountant(num_projections):
    acc = _accountant(num_projections, **RUN)
    eps = accounting.compute_epsilon(**RUN, delta=DELTA, num_projections=num_projections)
    assert eps == acc.epsilon(DELTA)
    assert accounting.compute_delta(
        **RUN, epsilon=eps, num_projections=num_projections
    ) == acc.delta(eps)
    assert accounting.compute_rdp_epsilon(
        **RUN, delta=DELTA, num_projections=num_projections
    ) == acc.rdp_epsilon(DELTA)
    if num_projections is None:
        assert accounting.compute_gdp_mu(**RUN) == acc.gdp_mu()
        mu = acc.gdp_mu()
        assert accounting.gdp_delta(mu=mu, epsilon=eps) == pytest.approx(
            math.erfc(-(-eps / mu + mu / 2) / math.sqrt(2)) / 2
            - math.exp(eps) * math.erfc(-(-eps / mu - mu / 2) / math.sqrt(2)) / 2
        )
        assert accounting.gdp_delta(
            mu=mu, epsilon=accounting.gdp_epsilon(mu=mu, delta=DELTA)
        ) == pytest.approx(DELTA, rel=1e-6)


def test_calibration_and_max_steps_match_the_accountant():
    sigma = accounting.calibrate_noise_multiplier(**CALLS["calibrate_noise_multiplier"])
    run = dict(RUN, noise_multiplier=sigma)
    assert _accountant(**run).epsilon(DELTA) <= 1.0 < _accountant(
        **dict(run, noise_multiplier=sigma / 1.002)).epsilon(DELTA)
    n = accounting.compute_max_steps(**CALLS["compute_max_steps"])
    assert _accountant(**dict(RUN, steps=n)).epsilon(DELTA) <= 1.0
    assert _accountant(**dict(RUN, steps=n + 1)).epsilon(DELTA) > 1.0


def test_top_level_reexport_is_the_keyword_only_function():
    import tf_dp

    assert tf_dp.compute_epsilon is accounting.compute_epsilon
    with pytest.raises(TypeError, match="keyword arguments only"):
        tf_dp.compute_epsilon(1.0, 0.01, 100, DELTA)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
