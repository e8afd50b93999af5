"""Keeps the accountant current during fit; epsilon in the logs; the target budget."""

from __future__ import annotations

import logging
import math

import keras

from tf_dp.accounting.functions import epsilon_text

_LOG = logging.getLogger("tf_dp")

#: warn when the JL epsilon exceeds exact clipping's by this factor.
JL_GAP_WARNING = 1.5


class PrivacyCallback(keras.callbacks.Callback):
    """Added by ``DPModel.fit`` in front of the user's callbacks (so History and the
    progress bar see ``epsilon``).

    The steps themselves are recorded by the optimizer where the noise is added (its ledger);
    after every batch this callback moves them into the model's accountant. At the end of each
    epoch it puts ``epsilon`` (at the model's ``privacy_delta``, rounded up to the digits the
    progress bar prints: ``shown_up``) in the logs; for JL optimizers
    also ``epsilon_exact_clipping``, the epsilon exact clipping would have at the same sigma,
    q and steps, with a warning when the JL one is much larger. With a ``target_epsilon``,
    ``fit`` cuts the data stream at the last affordable step and this callback stops training
    there.

    Args:
      max_steps: steps this fit may take within the target epsilon (None: no target).
      verbose: fit's verbosity; 0 silences the stop message.
      planned_steps: the steps the fit was asked for (epochs x steps per epoch), where Keras
        would run more (``steps_per_execution`` not dividing an endless input's epochs): it
        stops there, silently (None: Keras' own count).
    """

    def __init__(self, max_steps=None, verbose="auto", planned_steps=None):
        super().__init__()
        self.max_steps = max_steps
        self.planned_steps = planned_steps
        self.verbose = verbose
        self._start = 0
        self._warned = False

    def on_train_begin(self, logs=None):
        self._start = self.model.accountant.steps

    def on_train_batch_end(self, batch, logs=None):
        taken = self.model.accountant.steps - self._start
        if self.max_steps is not None and taken >= self.max_steps:
            if self.verbose != 0 and not self.model.stop_training:
                _LOG.warning("tf_dp: stopping: the next step would exceed the target epsilon "
                             "%g at delta %g.", self.model.target_epsilon,
                             self.model.privacy_delta)
            self.model.stop_training = True
        if self.planned_steps is not None and taken >= self.planned_steps:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        epsilon = self.model.epsilon()
        logs["epsilon"] = shown_up(epsilon)
        if self.model.exact_clipping_accountant.steps:
            exact = self.model.epsilon(exact_clipping=True)
            logs["epsilon_exact_clipping"] = shown_up(exact)
            if not self._warned and epsilon > JL_GAP_WARNING * exact:
                self._warned = True
                _LOG.warning(
                    "tf_dp: JL norms cost epsilon %s; exact clipping at the same sigma, q and "
                    "steps would cost %s: use larger r (or exact clipping) for the final run; "
                    "small r is for fast hyper-parameter search (Bu et al. 2021).",
                    epsilon_text(epsilon), epsilon_text(exact))


def shown_up(value: float) -> float:
    """``value`` rounded UP to the digits Keras' progress bar prints (``%.4f`` above 1e-3,
    ``%.4e`` below), so that the bar never shows an epsilon below the accountant's: it
    rounds to nearest, and showed 2.8545 for 2.85452747 (session 23 audit). The logs, and
    so History, hold this value; ``model.epsilon()`` is unrounded."""
    import decimal

    if not math.isfinite(value) or value <= 0:
        return value
    up = decimal.ROUND_CEILING
    # Digits enough for any float's exact value at 4 decimals (1e300 has 301 before them).
    with decimal.localcontext(decimal.Context(prec=1200)):
        exact = decimal.Decimal(value)
        if value <= 1e-3:
            exact = exact.quantize(decimal.Decimal(1).scaleb(exact.adjusted() - 4), rounding=up)
        if exact > decimal.Decimal("1e-3"):  # (also where the line above rounded past 1e-3)
            exact = exact.quantize(decimal.Decimal("0.0001"), rounding=up)
        rounded = float(exact)
    return rounded if rounded >= value else math.nextafter(rounded, math.inf)


def max_additional_steps(accountant, target_epsilon, delta, mechanism, limit=10**8):
    """Largest m such that m more steps of ``mechanism`` keep epsilon <= target.

    Epsilon grows with the number of steps, so an exponential search followed by bisection
    over copies of the accountant finds m with O(log m) epsilon evaluations.
    """
    from tf_dp.accounting.functions import largest_fitting

    def fits(m):
        acc = type(accountant).from_config(accountant.get_config())
        acc.step(count=m, **mechanism)
        return acc.epsilon(delta) <= target_epsilon

    return largest_fitting(fits, limit)
