"""dllm-rl: reinforcement-learning post-training of masked-diffusion language models.

Importing the package registers the native masked-diffusion model with the transformers Auto classes, so
`AutoModel.from_pretrained("models/<name>")` loads the embedded models. The registration waits for transformers'
Auto classes to be imported (at once if they already are): `import dllm_rl` itself stays cheap, so the command
line's `--help`, `--cfg` and config errors do not pay for torch and transformers.
"""

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

AUTO_MODULE = "transformers.models.auto.modeling_auto"  # where AutoModel lives: registered right after it loads


def _register() -> None:
    from dllm_rl.policy.modeling import register_auto_classes

    register_auto_classes()


class _RegisterAfterAutoClasses(importlib.abc.MetaPathFinder):
    """A one-shot import hook: finds `AUTO_MODULE` as the other finders do, and registers the native model once
    that module has run."""

    def find_spec(self, name, path, target=None):
        if name != AUTO_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_then_register(module) -> None:
                run(module)
                _register()

            spec.loader.exec_module = exec_then_register
        return spec


# DeepSpeed (imported by transformers' integrations) warns on every import when it finds no GPU; an NVIDIA driver is
# what a GPU needs here, and looking for it costs nothing (torch.cuda would import torch)
if not os.path.exists("/proc/driver/nvidia"):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
if AUTO_MODULE in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterAfterAutoClasses())
