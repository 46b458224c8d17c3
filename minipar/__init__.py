"""minipar: the techniques that train large models on many accelerators,
from scratch on torch.distributed.

    import minipar
    cfg = minipar.GPTConfig.preset("tiny")
    res = minipar.train(cfg, minipar.ParallelConfig(), steps=20, global_batch=8, data="shakespeare")

Its names (`__all__`: train, launch, plan, estimate, GPT, GPTConfig, ParallelConfig, Cluster, Mesh,
comm, pipeline, ...) and its submodules (minipar.memory, minipar.planner...) are imported when first
used (PEP 562), so `import minipar; minipar.prestart()` starts the worker server before this
process has imported torch.
"""
import importlib as _importlib
import sys as _sys
import types as _types

from minipar.server import prestart

_HOME = {"ParallelConfig": "config", "WorkerError": "launch", "WorkerTimeout": "launch",
         "heartbeat": "launch", "launch": "launch", "Mesh": "mesh", "GPT": "model",
         "GPTConfig": "model", "Estimate": "planner", "NoFeasiblePlan": "planner",
         "estimate": "planner", "explain": "planner", "format_table": "planner", "plan": "planner",
         "Cluster": "planner.cluster", "NonFiniteLoss": "train", "TrainResult": "train",
         "train": "train"}

__all__ = ["comm", "demos", "pipeline", "tensor_parallel", *_HOME, "prestart"]


def __getattr__(name: str):
    # a name of __all__ from the module that defines it; `demos` (lessons.demos) or any submodule
    if name in _HOME:
        return getattr(_importlib.import_module(f"minipar.{_HOME[name]}"), name)
    module = f"minipar.{'lessons.demos' if name == 'demos' else name}"
    try:
        return _importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # the submodule exists and failed to import something
        raise AttributeError(f"module 'minipar' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*__all__, "__doc__", "__file__", "__name__", "__path__"})


class _Package(_types.ModuleType):
    """Importing a submodule sets it on its package: `minipar.train` and `minipar.launch` stay the
    functions of those names (setting either to a module is ignored)."""

    def __setattr__(self, name, value):
        if not (name in _HOME and isinstance(value, _types.ModuleType)):
            super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
