"""The step strategies memfit has, in the order their memory terms apply (memfit/strategies/step_strategy.py
says what an entry holds). A new one is its module plus one line here."""

from memfit.strategies.activation_offload import ACTIVATION_OFFLOAD
from memfit.strategies.loss import CHUNKED_LOSS
from memfit.strategies.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
from memfit.strategies.tiled_mlp import TILED_MLP

STEP_STRATEGIES = (CHUNKED_LOSS, OPTIMIZER_IN_BACKWARD, TILED_MLP, ACTIVATION_OFFLOAD)
