"""Records every logical private step in the model's accountant; epsilon in the logs."""

from __future__ import annotations

import keras


def _steps(optimizer) -> int:
    # optimizer.iterations may be a MirroredVariable: int() of it fails, numpy works.
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


#: warn when the JL epsilon exceeds exact clipping's by this factor.
JL_GAP_WARNING = 1.5


class PrivacyCallback(keras.callbacks.Callback):
    """Added by ``DPModel.fit`` in front of the user's callbacks (so History and the
    progress bar see ``epsilon``).

    After every batch it records the logical steps the optimizer took (sigma, q, r); at the
    end of each epoch it puts ``epsilon`` (at the model's ``privacy_delta``) in the logs; for
    JL optimizers also ``epsilon_exact_clipping``, the epsilon exact clipping would have at
    the same sigma, q and steps, with a warning when the JL one is much larger.
    With a ``target_epsilon`` it stops training right after the last step whose epsilon
    stays within the target, i.e. before the step that would exceed it.

    Args:
      sampling_probability: q of each logical step.
      assumes_poisson: False when training on fixed batches (the report says so).
    """

    def __init__(self, sampling_probability: float, assumes_poisson: bool = True):
        super().__init__()
        self.sampling_probability = float(sampling_probability)
        self.assumes_poisson = assumes_poisson
        self._recorded = 0
        self._max_steps = None
        self._warned = False

    def _mechanism(self):
        opt = self.model.optimizer
        return dict(noise_multiplier=opt.noise_multiplier,
                    sampling_probability=self.sampling_probability,
                    num_projections=getattr(opt, "num_projections", None))

    def remaining_steps(self, model):
        """Steps left within ``model.target_epsilon`` (None: no target). Called by ``fit``
        before training, since Keras runs one batch before it looks at ``stop_training``."""
        self.set_model(model)
        target = model.target_epsilon
        self._max_steps = None
        if target is not None:
            self._max_steps = max_additional_steps(model.accountant, target,
                                                   model.privacy_delta, self._mechanism())
        return self._max_steps

    def on_train_begin(self, logs=None):
        self._recorded = _steps(self.model.optimizer)

    def on_train_batch_end(self, batch, logs=None):
        steps = _steps(self.model.optimizer)
        new = steps - self._recorded
        if new > 0:
            mechanism = self._mechanism()
            self.model.accountant.step(count=new, **mechanism)
            if mechanism["num_projections"] is not None:
                # What exact clipping would have cost at the same sigma, q and steps.
                self.model.exact_clipping_accountant.step(
                    count=new, **{**mechanism, "num_projections": None})
            self._recorded = steps
            if self._max_steps is not None:
                self._max_steps -= new
                if self._max_steps <= 0:
                    print(f"tf_dp: stopping: the next step would exceed the target epsilon "
                          f"{self.model.target_epsilon:g} at delta "
                          f"{self.model.privacy_delta:g}.")
                    self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs["epsilon"] = self.model.epsilon()
        if self._mechanism()["num_projections"] is not None:
            exact = self.model.epsilon(exact_clipping=True)
            logs["epsilon_exact_clipping"] = exact
            if not self._warned and logs["epsilon"] > JL_GAP_WARNING * exact:
                self._warned = True
                print(f"tf_dp: JL norms with r={self._mechanism()['num_projections']} cost "
                      f"epsilon {logs['epsilon']:.4g}, exact clipping at the same sigma, q and "
                      f"steps would cost {exact:.4g}: use larger r (or exact clipping) for the "
                      "final run; small r is for fast hyper-parameter search (Bu et al. 2021).")


def max_additional_steps(accountant, target_epsilon, delta, mechanism, limit=10**8):
    """Largest m such that m more steps of ``mechanism`` keep epsilon <= target.

    Epsilon grows with the number of steps, so an exponential search followed by bisection
    over copies of the accountant finds m with O(log m) epsilon evaluations.
    """

    def eps_after(m):
        acc = type(accountant).from_config(accountant.get_config())
        acc.step(count=m, **mechanism)
        return acc.epsilon(delta)

    if eps_after(1) > target_epsilon:
        return 0
    lo, hi = 1, 2
    while hi < limit and eps_after(hi) <= target_epsilon:
        lo, hi = hi, hi * 2
    if hi >= limit:
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps_after(mid) <= target_epsilon:
            lo = mid
        else:
            hi = mid
    return lo
