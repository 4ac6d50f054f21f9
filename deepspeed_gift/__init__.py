"""deepspeed-gift: low-precision ZeRO-1/2 gradient communication in geometry-aware coordinates.

Use ``deepspeed_gift.initialize`` where you called ``deepspeed.initialize``; the
``"gift"`` block of ds_config.json says what to do (every key: docs/config.md).
"""

__version__ = "0.1.0"

from .config import GiftConfig, get_gift_config  # noqa: E402
from .core.formats import FORMAT_NAMES, Codec, Payload, get_format  # noqa: E402
from .core.rng import CounterRng  # noqa: E402
from .core.geometry import (CovarianceEMA, FactoredScaling, LowRankDiag, Transform, Whitener,  # noqa: E402
                            factored_scaling_from_sums, fit_low_rank_diag, fit_whitener, make_whitener)
from .switch import initialize, install, installed, uninstall  # noqa: E402
from .zero import GiftState, attach, detach  # noqa: E402

__all__ = [
    # entry points
    "initialize",
    "attach",
    "detach",
    "install",
    "uninstall",
    "installed",
    "GiftState",
    # configuration
    "GiftConfig",
    "get_gift_config",
    # formats
    "FORMAT_NAMES",
    "Codec",
    "Payload",
    "get_format",
    "CounterRng",
    # geometry
    "CovarianceEMA",
    "FactoredScaling",
    "factored_scaling_from_sums",
    "LowRankDiag",
    "Transform",
    "Whitener",
    "fit_low_rank_diag",
    "fit_whitener",
    "make_whitener",
    "__version__",
]
