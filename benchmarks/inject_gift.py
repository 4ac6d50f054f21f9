"""pytest plugin: every ZeRO stage 1/2/3 engine a test suite builds gets a lossless GIFT block.

    PYTHONPATH=. GIFT_INJECT_LOG=runs/inject.jsonl .venv/bin/python -m pytest -p benchmarks.inject_gift <tests>

Loaded in the pytest process, it turns injection on there and, through a generated
``sitecustomize.py`` put first on ``PYTHONPATH``, in every Python process started from it
(DeepSpeed's ``DistributedTest`` runs test bodies in ``forkserver``/``spawn`` children, which
import neither pytest's plugins nor this module by themselves).

In each process ``deepspeed.initialize`` is wrapped once ``deepspeed`` is imported. A call whose
config (``config``/``config_params`` as a dict or a json path, or ``args.deepspeed_config``) has
``zero_optimization.stage`` in ``GIFT_INJECT_STAGES`` (default ``1,2,3``) and no ``"gift"`` block is
rebuilt through ``deepspeed_gift.initialize`` with :data:`GIFT_BLOCK` added to a copy of the
config (the caller's dict is not changed); any other call goes to DeepSpeed untouched.

One json line per ``deepspeed.initialize`` call goes to ``$GIFT_INJECT_LOG`` (when set):
``outcome`` is ``attached`` (the engine has GIFT), ``not_attached`` (injected, built, but no
GIFT state), ``refused`` (a ``ValueError`` starting with ``"gift."``; re-raised, so the test sees
it), ``error`` (any other exception while building an injected engine; re-raised),
``skipped_stage`` (stage not in ``GIFT_INJECT_STAGES``), ``skipped_no_optimizer`` (neither an
optimizer nor an ``"optimizer"`` block: no gradient reduction, which GIFT refuses) or ``has_block``
(the config already had a ``"gift"`` block; built through ``deepspeed_gift.initialize`` as given).
"""

from __future__ import annotations

import json
import os
import sys

GIFT_BLOCK = {"enabled": True, "format": "fp32", "geometry": {"kind": "identity"}, "layers": "all"}

ENV_ON = "GIFT_INJECT"  # "1": wrap deepspeed.initialize in this process
ENV_LOG = "GIFT_INJECT_LOG"  # jsonl file, one line per deepspeed.initialize call
ENV_STAGES = "GIFT_INJECT_STAGES"  # ZeRO stages that get the block, default "1,2,3"
ENV_SITE = "GIFT_INJECT_SITEDIR"  # where the generated sitecustomize.py goes

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HERE = os.path.abspath(__file__)
_inside = 0  # depth of injected builds: deepspeed_gift.initialize calls deepspeed.initialize again


def _stages():
    raw = os.environ.get(ENV_STAGES, "1,2,3")
    return {int(s) for s in raw.replace(" ", "").split(",") if s}


def _current_test():
    """The pytest node id being run: the pytest process writes it to ``<log>.current``."""
    log = os.environ.get(ENV_LOG)
    if log:
        try:
            with open(log + ".current") as f:
                return f.read().strip()
        except OSError:
            pass
    return None


def _record(**fields):
    log = os.environ.get(ENV_LOG)
    if not log:
        return
    fields.setdefault("test", _current_test())
    fields.setdefault("pid", os.getpid())
    fields.setdefault("rank", os.environ.get("RANK"))
    line = json.dumps(fields, default=str) + "\n"
    with open(log, "a") as f:  # one short append per line: whole lines from concurrent ranks
        f.write(line)


def _zero_stage(cfg):
    zero = cfg.get("zero_optimization")
    if zero is None or zero is False:
        return 0
    if zero is True:  # the old boolean form meant stage 1
        return 1
    if isinstance(zero, dict):
        return int(zero.get("stage", 0))
    return 0


def _wrap_initialize(module) -> None:
    native = getattr(module, "initialize", None)
    if native is None or getattr(native, "_gift_inject", False):
        return
    import copy
    import functools
    import inspect

    signature = inspect.signature(native)

    @functools.wraps(native)
    def initialize(*args, **kwargs):
        global _inside
        if _inside:  # deepspeed_gift.initialize building the engine we handed it
            return native(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs)
        call = dict(bound.arguments)
        ds_args = call.get("args")
        config = call.get("config")
        if config is None and call.get("config_params") is not None:
            config = call["config_params"]
        source = "dict"
        from_args = False
        if config is None:
            for attr in ("deepspeed_config", "deepscale_config"):
                if getattr(ds_args, attr, None) is not None:
                    config, from_args, source = getattr(ds_args, attr), attr, "args." + attr
                    break
        if config is None:  # DeepSpeed itself will complain
            _record(outcome="no_config")
            return native(*args, **kwargs)
        if not isinstance(config, dict):
            if source == "dict":
                source = "path"
            from deepspeed.runtime.config import load_ds_config  # the json reading DeepSpeed does
            config = load_ds_config(config)
        stage = _zero_stage(config)
        has_block = "gift" in config
        if not has_block and stage not in _stages():
            _record(outcome="skipped_stage", stage=stage, source=source)
            return native(*args, **kwargs)
        if not has_block and call.get("optimizer") is None and "optimizer" not in config:
            # no optimizer: no gradient reduction (stage 3 builds only its parameter partitioner),
            # which GIFT refuses at initialize; a user would not give such an engine a gift block
            _record(outcome="skipped_no_optimizer", stage=stage, source=source)
            return native(*args, **kwargs)
        if not has_block:
            config = dict(config)
            config["gift"] = copy.deepcopy(GIFT_BLOCK)
        call.pop("config_params", None)
        call["config"] = config
        if from_args:  # the config now goes in as a dict; the args object must not name one too
            ds_args = copy.copy(ds_args)
            setattr(ds_args, from_args, None)
            if hasattr(ds_args, "deepscale_config"):
                ds_args.deepscale_config = None
            call["args"] = ds_args
        import deepspeed_gift

        _inside += 1
        try:
            result = deepspeed_gift.initialize(**call)
        except ValueError as exc:
            msg = str(exc)
            outcome = "refused" if msg.startswith("gift.") else "error"
            _record(outcome=outcome, stage=stage, source=source, message=msg[:500],
                    exception=type(exc).__name__)
            raise
        except Exception as exc:
            _record(outcome="error", stage=stage, source=source, message=str(exc)[:500],
                    exception=type(exc).__name__)
            raise
        finally:
            _inside -= 1
        engine = result[0]
        attached = getattr(engine, "gift", None) is not None
        _record(outcome=("has_block" if has_block and attached else "attached" if attached else "not_attached"),
                stage=stage, source=source, engine=type(engine).__name__,
                optimizer=type(getattr(engine, "optimizer", None)).__name__)
        return result

    initialize._gift_inject = True
    initialize._gift_native = native
    module.initialize = initialize


def _activate() -> None:
    """Wrap ``deepspeed.initialize`` now if DeepSpeed is imported, else right after it is."""
    sys.path.insert(0, _REPO)  # the startup hook's module, at the repository's root
    from deepspeed_gift_hook import after_import

    after_import("deepspeed", _wrap_initialize)


_SITECUSTOMIZE = '''\
# generated by benchmarks/inject_gift.py: turn GIFT injection on in every Python process
import os as _os
if _os.environ.get({on!r}) == "1":
    try:
        import importlib.util as _u, sys as _s
        _spec = _u.spec_from_file_location("_gift_inject_site", {path!r})
        _m = _u.module_from_spec(_spec)
        _s.modules["_gift_inject_site"] = _m
        _spec.loader.exec_module(_m)
        _m._activate()
    except Exception as _e:
        print("inject_gift: not active in this process:", repr(_e), file=_s.stderr)
'''


def _install_sitecustomize() -> str:
    import tempfile

    site = os.environ.get(ENV_SITE) or tempfile.mkdtemp(prefix="gift_inject_site_")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(on=ENV_ON, path=_HERE))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for extra in (_REPO, site):
        if extra not in parts:
            parts.insert(0, extra)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    return site


# pytest hooks (only the pytest process loads this module as a plugin)

def pytest_configure(config):
    os.environ[ENV_ON] = "1"
    site = _install_sitecustomize()
    _activate()
    config._gift_inject_site = site


def pytest_report_header(config):
    return (f"inject_gift: gift block {json.dumps(GIFT_BLOCK)} for ZeRO stages {sorted(_stages())}; "
            f"log {os.environ.get(ENV_LOG)}")


def pytest_runtest_logstart(nodeid, location):
    log = os.environ.get(ENV_LOG)
    if log:
        with open(log + ".current", "w") as f:
            f.write(nodeid)
