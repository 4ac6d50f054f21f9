"""The switch: GIFT for engines that ``deepspeed_gift.initialize`` builds, and, once
:func:`install` is called or ``DEEPSPEED_GIFT=1`` is set, for every DeepSpeed engine whose
config has an enabled ``gift`` block, whoever builds it (HF Trainer, Accelerate, Lightning).
``deepspeed_gift_hook`` (loaded at interpreter start, no torch) wraps DeepSpeed's engine
``__init__`` and calls :func:`after_engine_init`."""

from __future__ import annotations

import logging
import os

from .config import GIFT_KEY as GIFT_BLOCK
from .config import get_gift_config
from .zero import attach, log_like_deepspeed

logger = logging.getLogger("deepspeed_gift")


_installed = False
_attaching = 0  # inside deepspeed_gift.initialize: its engine gets GIFT whatever the switch
_warned = False


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with GIFT attached when the config's ``gift`` block is enabled.
    Same arguments and return value."""
    import deepspeed

    config = kwargs.get("config", kwargs.get("config_params"))
    if isinstance(config, dict):
        get_gift_config(config)  # fail on a bad block before building the engine
    global _attaching
    _attaching += 1
    try:
        result = deepspeed.initialize(*args, **kwargs)
    finally:
        _attaching -= 1
    if getattr(result[0], "gift", None) is None:
        attach(result[0])
    return result




def install() -> None:
    """Every DeepSpeed engine built from now on whose config has an enabled ``gift`` block gets
    GIFT, whoever builds it (HF Trainer, Accelerate, Lightning, ``deepspeed.initialize``).
    Idempotent; :func:`uninstall` undoes it. ``DEEPSPEED_GIFT=1`` in every rank's environment
    does the same without code."""
    import deepspeed_gift_hook

    global _installed
    _installed = True
    deepspeed_gift_hook.watch_deepspeed()


def uninstall() -> None:
    """Engines built from now on no longer get GIFT unless built by ``deepspeed_gift.initialize``
    (engines that have it keep it). An enabled block is then warned about again."""
    global _installed
    _installed = False


def installed() -> bool:
    """Whether engines built now get GIFT from their config alone."""
    import deepspeed_gift_hook

    return _installed or os.environ.get(deepspeed_gift_hook.ENV_SWITCH, "") == "1"


def after_engine_init(engine) -> None:
    """Called when any ``DeepSpeedEngine`` has been built (the startup hook wraps its
    ``__init__``): attaches GIFT when the switch is on and the config has an enabled block;
    otherwise says once that the block is not in effect. An invalid block fails here, as it
    would under ``deepspeed_gift.initialize``."""
    global _warned
    from deepspeed.runtime.engine import DeepSpeedEngine

    raw = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if not isinstance(raw, dict) or GIFT_BLOCK not in raw or getattr(engine, "gift", None) is not None:
        return
    log_like_deepspeed()
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if type(engine) not in (DeepSpeedEngine, PipelineEngine):  # a hybrid or DualPipeV engine: not served
        if _attaching:  # deepspeed_gift.initialize attaches (or refuses) once it is built
            return
        logger.warning("gift: the DeepSpeed config has a \"gift\" block, but GIFT serves DeepSpeedEngine and "
                       "PipelineEngine, not a %s; this one runs natively (deepspeed_gift.attach(engine) tries it "
                       "once built)", type(engine).__name__)
        return
    if _attaching or installed():
        attach(engine)
    elif not _warned and get_gift_config(raw).enabled:
        _warned = True
        logger.warning("gift: the DeepSpeed config has an enabled \"gift\" block, but this engine was built without "
                       "GIFT, so it runs DeepSpeed's native reduction. Call deepspeed_gift.install() before the "
                       "engine is built (HF Trainer, Accelerate, Lightning), set DEEPSPEED_GIFT=1 for every rank, or "
                       "build it with deepspeed_gift.initialize")
