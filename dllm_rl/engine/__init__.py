"""Everything DeepSpeed and torch.distributed: the DeepSpeed config from flat arguments, the process group
(launched or single-process), the learner engine, ZeRO-3 gathering for generation, checkpoints and export.
Nothing else in the package imports deepspeed."""

from dllm_rl.engine.config import OFFLOAD_DEVICES, STAGES, deepspeed_config
from dllm_rl.engine.dist import (World, all_gather_objects, all_max, all_sum, any_rank, barrier, broadcast_object,
                                 gather_tensor, init_distributed, mean_metrics, scatter_objects, shutdown)
from dllm_rl.engine.rendezvous import RankFailed, peers_answering, roll_call, stop_together
from dllm_rl.engine.engine import (CHECKPOINT_TAG, Engine, Update, deepspeed_state_classes, gather_parameters,
                                   partitioned_loading)

# The options of the `deepspeed` config group that reach `deepspeed_config` (timeout_s goes to the process group).
ENGINE_OPTIONS = ("stage", "bf16", "offload_optimizer", "offload_params")
