"""dllm-rl: reinforcement-learning post-training of masked-diffusion language models.

Importing the package registers the native masked-diffusion model with the transformers Auto classes, so
`AutoModel.from_pretrained("models/<name>")` loads the embedded models.
"""

import os

__version__ = "0.1.0"


def _register() -> None:
    import torch

    # DeepSpeed (imported by transformers' integrations) warns on every import when it finds no GPU.
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dllm_rl.policy.modeling import register_auto_classes

    register_auto_classes()


_register()
