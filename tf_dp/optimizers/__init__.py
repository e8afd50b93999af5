"""tf_dp optimizers: Keras 3 optimizers with a differentially private update."""

from tf_dp.optimizers.dp_adam import DPAdam
from tf_dp.optimizers.dp_adam_jl import DPAdamJL
from tf_dp.optimizers.dp_adamw import DPAdamW
from tf_dp.optimizers.dp_adamw_jl import DPAdamWJL
from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin
from tf_dp.optimizers.dp_sgd import DPSGD
from tf_dp.optimizers.dp_sgd_jl import DPSGDJL
from tf_dp.optimizers.factory import make_private_optimizer, private_class

__all__ = ["DPSGD", "DPAdam", "DPAdamW", "DPSGDJL", "DPAdamJL", "DPAdamWJL", "DPOptimizerMixin",
           "make_private_optimizer", "private_class"]
