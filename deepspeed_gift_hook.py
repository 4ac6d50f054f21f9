"""Startup hook of deepspeed-gift: makes every DeepSpeed engine built from a config with an
enabled ``"gift"`` block get GIFT, whoever builds it (HF Trainer, Accelerate, Lightning, a
script calling ``deepspeed.initialize``), or warn that it did not.

Loaded at interpreter start by ``deepspeed_gift.pth`` (installed with the package); it
imports nothing heavy: it only watches for ``deepspeed.runtime.engine`` to be imported and
then wraps ``DeepSpeedEngine.__init__`` (and its subclasses', ``PipelineEngine``'s) so that,
once an engine is built,
``deepspeed_gift.switch.after_engine_init`` decides. That decision attaches GIFT when the
switch is on (``deepspeed_gift.install()``, or ``DEEPSPEED_GIFT=1`` in the environment of
every rank) and otherwise warns once that the block is not in effect.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

ENGINE_MODULE = "deepspeed.runtime.engine"
ENV_SWITCH = "DEEPSPEED_GIFT"


def _wrap_init(cls) -> None:
    """``cls.__init__`` followed, once the outermost ``__init__`` of the engine being built has
    run (a ``PipelineEngine`` calls ``DeepSpeedEngine.__init__`` half-way through its own), by
    ``deepspeed_gift.switch.after_engine_init``."""
    native = cls.__dict__.get("__init__")
    if native is None or getattr(native, "_gift_wrapped", False):
        return

    def __init__(self, *args, **kwargs):
        native(self, *args, **kwargs)
        mro = type(self).__mro__
        if any(getattr(k.__dict__.get("__init__"), "_gift_wrapped", False) for k in mro[:mro.index(cls)]):
            return  # a subclass's __init__ is still running: its wrapper decides when it is done
        try:
            from deepspeed_gift.switch import after_engine_init
        except ImportError as exc:  # a broken install must not stop engines that have no gift block
            print(f"deepspeed_gift: not importable, engines run without GIFT: {exc}", file=sys.stderr)
            return
        after_engine_init(self)  # a bad gift block fails here, as under deepspeed_gift.initialize

    __init__._gift_wrapped = True
    __init__._gift_native = native
    __init__.__doc__ = native.__doc__
    cls.__init__ = __init__


def _wrap_engine_class(module) -> None:
    """Wrap ``DeepSpeedEngine.__init__`` and that of every subclass, defined already or later
    (``PipelineEngine`` is defined after this module loads)."""
    cls = getattr(module, "DeepSpeedEngine", None)
    if cls is None or getattr(cls.__init__, "_gift_wrapped", False):
        return
    _wrap_init(cls)
    pending = list(cls.__subclasses__())
    while pending:
        sub = pending.pop()
        _wrap_init(sub)
        pending.extend(sub.__subclasses__())
    native_hook = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub, **kwargs):
        if native_hook is not None:
            native_hook.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        _wrap_init(sub)

    __init_subclass__._gift_native = native_hook
    cls.__init_subclass__ = classmethod(__init_subclass__)


def unwrap_engine_class() -> None:
    """Undo :func:`watch_deepspeed` on an imported DeepSpeed (tests, ``uninstall``)."""
    module = sys.modules.get(ENGINE_MODULE)
    cls = getattr(module, "DeepSpeedEngine", None)
    if cls is not None and getattr(cls.__init__, "_gift_wrapped", False):
        pending = [cls]
        while pending:
            one = pending.pop()
            pending.extend(one.__subclasses__())
            wrapped = one.__dict__.get("__init__")
            if getattr(wrapped, "_gift_wrapped", False):
                one.__init__ = wrapped._gift_native
        hook = cls.__dict__.get("__init_subclass__")
        if hook is not None and hasattr(hook.__func__, "_gift_native"):
            native_hook = hook.__func__._gift_native
            if native_hook is None:
                del cls.__init_subclass__
            else:
                cls.__init_subclass__ = native_hook
    for finder in [f for f in sys.meta_path if isinstance(f, AfterImport) and f.fullname == ENGINE_MODULE]:
        sys.meta_path.remove(finder)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when module ``fullname`` is about to load, it takes the spec the
    other finders give and runs ``then(module)`` right after the module's own code."""

    def __init__(self, fullname: str, then) -> None:
        self.fullname, self.then = fullname, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _WrappingLoader(spec.loader, self.then)
                return spec
        return None


def after_import(fullname: str, then) -> None:
    """``then(module)`` now if ``fullname`` is imported, else right after it is (once)."""
    module = sys.modules.get(fullname)
    if module is not None:
        then(module)
    elif not any(isinstance(f, AfterImport) and f.fullname == fullname and f.then is then for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(fullname, then))


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self.loader, name)


def watch_deepspeed() -> None:
    """Wrap ``DeepSpeedEngine.__init__`` now if DeepSpeed is imported, else when it is."""
    after_import(ENGINE_MODULE, _wrap_engine_class)


def startup() -> None:
    """Run by ``deepspeed_gift.pth`` at interpreter start; cheap, and never fails the start."""
    try:
        watch_deepspeed()
    except Exception as exc:  # a broken hook must not break every Python program
        print(f"deepspeed_gift: startup hook not installed: {type(exc).__name__}: {exc}", file=sys.stderr)


PTH_NAME = "deepspeed_gift.pth"
PTH_LINE = "import deepspeed_gift_hook; deepspeed_gift_hook.startup()\n"


def pth_path() -> str:
    import sysconfig

    return f"{sysconfig.get_path('purelib')}/{PTH_NAME}"


def main(argv=None) -> int:
    """``python -m deepspeed_gift_hook enable|disable|status``: write, remove or show the
    ``.pth`` file that loads this hook at start. A regular ``pip install`` writes it itself; an
    editable install (``pip install -e``) does not, so ``scripts/setup.sh`` runs ``enable``."""
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m deepspeed_gift_hook", description=main.__doc__.split("\n")[0])
    p.add_argument("action", choices=("enable", "disable", "status"))
    action = p.parse_args(argv).action
    path = pth_path()
    if action == "enable":
        with open(path, "w") as f:
            f.write(PTH_LINE)
    elif action == "disable" and os.path.exists(path):
        os.remove(path)
    print(f"{path}: {'present' if os.path.exists(path) else 'absent'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
