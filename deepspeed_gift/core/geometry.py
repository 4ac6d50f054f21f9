"""Input-side gradient geometry: statistics, low-rank factors, whitening transforms.

For a linear layer with input activations ``x`` (``in`` features) and weight gradient
``G`` (``out x in``):

* :class:`CovarianceEMA` tracks ``A = E[x x^T]`` (batch second moments smoothed by an EMA).
* :func:`fit_low_rank_diag` approximates ``A_hat = U diag(lam) U^T + diag(d)`` (top-``rank``
  eigenpairs plus the clamped residual diagonal).
* A :class:`Whitener` holds a linear map ``S`` with ``S^T A_hat S = I``; ``apply`` sends
  ``G -> Z = G S`` and ``invert`` maps back ``Z -> G = Z S^{-1}``. Both act row by row with
  the same ``S``, so any subset of a layer's rows can be transformed on its own.
* :class:`FactoredScaling` is Adam's geometry instead of the input's: ``Z = G * a b^T``
  elementwise, with ``a``, ``b`` from the row and column means of Adam's second moment
  (:func:`factored_scaling_from_sums`). Every element has its own factor, so any run of a
  layer's elements, partial rows included, can be transformed on its own.

Every transform also acts on a flat run of a parameter (``apply_run(values, start)``):
``run_unit`` says what a run must be made of (whole rows for a whitener, any elements for
a scaling), which is what the reduction needs to know to cut a ZeRO slice.

Pure tensor math: no ``torch.distributed``, no DeepSpeed. Every random choice uses an
explicitly seeded CPU generator, so identical inputs give identical bits on every rank.
Factors are fitted in float64 (see :func:`fit_low_rank_diag`) and stored in float32;
transforms compute in float32 whatever the input dtype.
"""

from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from .devices import host_to_device

__all__ = [
    # statistics
    "CovarianceEMA",
    "second_moment",
    # low-rank + diagonal factors
    "LowRankDiag",
    "fit_low_rank_diag",
    "low_rank_to_dense",
    "blend_low_rank",
    "AUTO_EIGH_MAX_DIM",
    "FIT_METHODS",
    # whiteners
    "Whitener",
    "StructuredWhitener",
    "CholeskyWhitener",
    "HadamardWhitener",
    "IdentityWhitener",
    "SOLVERS",
    # entry points
    "fit_whitener",
    "make_whitener",
    "whitener_from_low_rank",
    # Adam's geometry
    "FactoredScaling",
    "row_col_sums",
    "row_runs",
    "factored_scaling_from_sums",
    "SCALING_FLOOR",
]

# Above this input dimension "by_width" switches from exact eigh (O(in^3)) to the randomized
# range finder (O(in^2 r)); below it eigh is both exact and cheap enough.
AUTO_EIGH_MAX_DIM = 1024
FIT_METHODS = ("by_width", "eigh", "randomized")
SOLVERS = ("structured", "cholesky")

# Factor fitting runs in float64: the residual diagonal diag(A) - diag(U lam U^T) is a
# difference of nearly equal numbers along the dominant directions, and the eigenvalues of
# activation covariances span many orders of magnitude.
_FIT_DTYPE = torch.float64
_FACTOR_DTYPE = torch.float32


# --------------------------------------------------------------------------- statistics


@torch.no_grad()
def second_moment(x: Tensor) -> Tensor:
    """Batch second moment ``x^T x / n`` in float32, for ``x`` of shape ``(..., dim)``.

    All leading dimensions are flattened into ``n`` samples. The result is what
    :meth:`CovarianceEMA.update_from_moment` expects, so the caller may average it over
    data-parallel ranks first.
    """
    if x.dim() == 0:
        raise ValueError("second_moment expects x of shape (..., dim), got a scalar")
    dim = x.shape[-1]
    rows = x.detach().reshape(-1, dim).to(torch.float32)
    n = rows.shape[0]
    if n == 0:
        raise ValueError(f"second_moment needs at least one sample, got x of shape {tuple(x.shape)}")
    return (rows.T @ rows).div_(n)


class GeometryKind(str, enum.Enum):
    """The kinds of transform (``gift.geometry.kind``), in the order the config lists them."""

    KFAC_INPUT = "kfac_input"  # input whitening from K-FAC statistics (fitted, refreshed)
    ADAM_FACTORED = "adam_factored"  # Adam's factored second moment (refitted from its state)
    IDENTITY = "identity"  # none: Euclidean
    HADAMARD = "hadamard"  # a seeded random-sign Hadamard rotation (data-independent)


@runtime_checkable
class Transform(Protocol):
    """The contract of a layer's transform, as the reduction uses it: ``apply_run`` moves a
    flat run of the parameter that starts at element ``start`` into the transform's coordinates,
    ``invert_run`` back; a run is made of whole ``run_unit``-element units (a whitener's rows;
    1 for an elementwise scaling); ``apply``/``invert`` do the same on the whole ``(out, in)``
    gradient (the selection's profile); ``version`` names the fit (ranks must agree on it: the
    bucket plan's hash includes it); ``to_tensors`` is its state for checkpoints and sharing.
    :class:`Whitener` (K-FAC, Hadamard, identity) and :class:`FactoredScaling` implement it."""

    version: int

    def apply(self, G: Tensor) -> Tensor: ...

    def invert(self, Z: Tensor) -> Tensor: ...

    @property
    def run_unit(self) -> int: ...

    def apply_run(self, values: Tensor, start: int) -> Tensor: ...

    def invert_run(self, values: Tensor, start: int) -> Tensor: ...

    def to_tensors(self) -> list[Tensor]: ...


class CovarianceEMA:
    """Exponential moving average of the input second moment ``A = E[x x^T]``.

    The first update sets the average directly; later ones blend
    ``A <- decay * A + (1 - decay) * M``. The average is float32 and lives on ``device``
    (or, when ``device`` is None, on the device of the first moment it sees).
    """

    def __init__(self, dim: int, *, decay: float, device: torch.device | str | None = None):
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"CovarianceEMA dim must be a positive int, got {dim!r}")
        if not (0.0 <= float(decay) < 1.0):
            raise ValueError(f"CovarianceEMA decay must be in [0, 1), got {decay!r}")
        self.dim = dim
        self.decay = float(decay)
        self.device = torch.device(device) if device is not None else None
        self.count = 0
        self._value: Tensor | None = None

    def update(self, x: Tensor) -> None:
        """Fold in a batch of inputs ``x`` of shape ``(..., dim)`` (any float dtype)."""
        if x.shape[-1:] != (self.dim,):
            raise ValueError(f"CovarianceEMA expects inputs of shape (..., {self.dim}), got {tuple(x.shape)}")
        self.update_from_moment(second_moment(x))

    @torch.no_grad()
    def update_from_moment(self, moment: Tensor) -> None:
        """Fold in a precomputed batch moment (e.g. :func:`second_moment` averaged over ranks)."""
        if moment.shape != (self.dim, self.dim):
            raise ValueError(
                f"CovarianceEMA expects a moment of shape ({self.dim}, {self.dim}), got {tuple(moment.shape)}"
            )
        if self.device is None:
            self.device = moment.device
        m = moment.detach().to(device=self.device, dtype=torch.float32)
        if self._value is None:
            self._value = m.clone()
        else:
            self._value.mul_(self.decay).add_(m, alpha=1.0 - self.decay)
        self.count += 1

    def value(self) -> Tensor:
        """The current average ``(dim, dim)`` float32. Read-only: it is the internal buffer."""
        if self._value is None:
            raise RuntimeError("CovarianceEMA.value() called before any update")
        return self._value

    def state_dict(self) -> dict:
        return {"dim": self.dim, "count": self.count, "value": self._value}

    def load_state_dict(self, state: dict) -> None:
        if state["dim"] != self.dim:
            raise ValueError(f"CovarianceEMA state has dim {state['dim']}, this tracker has dim {self.dim}")
        value = state["value"]
        if value is None:
            self._value = None
        else:
            if self.device is None:
                self.device = value.device
            self._value = value.detach().to(device=self.device, dtype=torch.float32).clone()
        self.count = int(state["count"])


# --------------------------------------------------------------- low-rank + diagonal fit


@dataclass
class LowRankDiag:
    """``A_hat = U diag(lam) U^T + diag(d)``: ``U`` (in x r) orthonormal, ``lam >= 0``, ``d >= damping``."""

    U: Tensor
    lam: Tensor
    d: Tensor

    def __post_init__(self):
        if self.U.dim() != 2 or self.lam.shape != (self.U.shape[1],) or self.d.shape != (self.U.shape[0],):
            raise ValueError(
                "LowRankDiag expects U (in, r), lam (r,), d (in,), got "
                f"U {tuple(self.U.shape)}, lam {tuple(self.lam.shape)}, d {tuple(self.d.shape)}"
            )

    @property
    def dim(self) -> int:
        return self.U.shape[0]

    @property
    def rank(self) -> int:
        return self.U.shape[1]


def low_rank_to_dense(lrd: LowRankDiag) -> Tensor:
    """The dense ``(in, in)`` float32 matrix ``U diag(lam) U^T + diag(d)``."""
    U = lrd.U.to(_FIT_DTYPE)
    dense = (U * lrd.lam.to(_FIT_DTYPE)) @ U.T
    dense.diagonal().add_(lrd.d.to(_FIT_DTYPE))
    return dense.to(_FACTOR_DTYPE)


def blend_low_rank(prev: LowRankDiag | None, A_new: Tensor, *, factor_decay: float) -> Tensor:
    """Matrix to fit at a refresh when factors are smoothed across refreshes.

    ``factor_decay * A_hat_prev + (1 - factor_decay) * A_new``, or ``A_new`` when there
    is no previous fit. Returns a dense float32 matrix; pass it to :func:`fit_low_rank_diag`.
    """
    if not (0.0 <= float(factor_decay) <= 1.0):
        raise ValueError(f"factor_decay must be in [0, 1], got {factor_decay!r}")
    if prev is None:
        return A_new.to(_FACTOR_DTYPE)
    if prev.dim != A_new.shape[-1]:
        raise ValueError(f"blend_low_rank: previous factors have dim {prev.dim}, new matrix {tuple(A_new.shape)}")
    prev_dense = low_rank_to_dense(prev).to(A_new.device)
    return prev_dense.mul_(factor_decay).add_(A_new.to(_FACTOR_DTYPE), alpha=1.0 - factor_decay)


def _check_rank(rank: int, dim: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    if rank > dim:
        raise ValueError(f"rank {rank} exceeds the layer input dimension {dim}")


def _top_eigh(A: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    evals, evecs = torch.linalg.eigh(A)
    # eigh sorts ascending; keep the largest `rank`, largest first.
    return evals.flip(0)[:rank], evecs.flip(1)[:, :rank]


def _top_randomized(A: Tensor, rank: int, *, seed: int, oversample: int, iters: int) -> tuple[Tensor, Tensor]:
    dim = A.shape[0]
    k = min(rank + oversample, dim)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    omega = torch.randn(dim, k, generator=gen, dtype=A.dtype).to(A.device)
    Q, _ = torch.linalg.qr(A @ omega)
    for _ in range(iters):
        # re-orthonormalize every power step, otherwise the small directions drown in rounding.
        Q, _ = torch.linalg.qr(A @ Q)
    T = Q.T @ (A @ Q)
    T = 0.5 * (T + T.T)
    evals, W = _top_eigh(T, rank)
    return evals, Q @ W


@torch.no_grad()
def fit_low_rank_diag(
    A: Tensor,
    *,
    rank: int,
    damping: float,
    method: str = "by_width",
    seed: int = 0,
    oversample: int = 8,
    iters: int = 2,
) -> LowRankDiag:
    """Top-``rank`` eigenpairs of ``A`` plus the residual diagonal, clamped at ``damping``.

    ``method``: ``"eigh"`` (exact, O(in^3)), ``"randomized"`` (range finder with
    ``oversample`` extra columns and ``iters`` power steps, O(in^2 (rank + oversample))),
    ``"by_width"`` (eigh up to :data:`AUTO_EIGH_MAX_DIM`, randomized above). The fit runs in
    float64 on ``A``'s device and returns float32 factors there (on GPUs with slow float64
    this costs more, but fits happen once per refresh). Eigenvalues are clamped at 0.
    Deterministic: the randomized test matrix comes from a CPU generator seeded with ``seed``.
    """
    if A.dim() != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"fit_low_rank_diag expects a square matrix, got shape {tuple(A.shape)}")
    dim = A.shape[0]
    _check_rank(rank, dim)
    if not (math.isfinite(damping) and damping > 0):
        raise ValueError(f"damping must be a positive finite number, got {damping!r}")
    if method not in FIT_METHODS:
        raise ValueError(f"method {method!r} not in allowed values {list(FIT_METHODS)}")
    if oversample < 0 or iters < 0:
        raise ValueError(f"oversample and iters must be >= 0, got oversample={oversample}, iters={iters}")
    if not bool(torch.isfinite(A).all()):
        raise ValueError("fit_low_rank_diag: A contains non-finite values")

    A64 = A.detach().to(_FIT_DTYPE)
    A64 = 0.5 * (A64 + A64.T)
    if method == "by_width":
        method = "eigh" if dim <= AUTO_EIGH_MAX_DIM else "randomized"
    if rank == 0:
        lam = A64.new_zeros(0)
        U = A64.new_zeros(dim, 0)
    elif method == "eigh":
        lam, U = _top_eigh(A64, rank)
    else:
        lam, U = _top_randomized(A64, rank, seed=seed, oversample=oversample, iters=iters)
    lam = lam.clamp(min=0.0)
    d = (A64.diagonal() - (U * U) @ lam).clamp(min=damping)
    return LowRankDiag(U=U.to(_FACTOR_DTYPE), lam=lam.to(_FACTOR_DTYPE), d=d.to(_FACTOR_DTYPE))


def low_rank_matmul(lrd: LowRankDiag, Q: Tensor) -> Tensor:
    """``A_hat @ Q`` without forming ``A_hat``."""
    return lrd.U @ (lrd.lam[:, None] * (lrd.U.T @ Q)) + lrd.d[:, None] * Q


def low_rank_diagonal(lrd: LowRankDiag) -> Tensor:
    return lrd.U.square() @ lrd.lam + lrd.d


def nystrom_low_rank_diag(omega: Tensor, Y: Tensor, diag: Tensor, *, rank: int,
                          damping: float) -> LowRankDiag:
    """Top-``rank`` eigenpairs of a PSD ``A`` from one sketch ``Y = A @ omega`` (omega
    orthonormal), by the shifted Nystrom approximation ``Y (omega^T Y)^-1 Y^T``, plus the
    clamped residual diagonal. Falls back to Rayleigh-Ritz when the core is not positive
    definite."""
    O, Y64 = omega.double(), Y.double()
    shift = 1e-10 * float(Y64.norm()) + 1e-300
    Ys = Y64 + shift * O
    core = O.T @ Ys
    core = 0.5 * (core + core.T)
    L, info = torch.linalg.cholesky_ex(core)
    if int(info) == 0:
        B = torch.linalg.solve_triangular(L, Ys.T, upper=False).T
        U, S, _ = torch.linalg.svd(B, full_matrices=False)
        lam = (S.square() - shift).clamp_min(0.0)[:rank]
        U = U[:, :rank]
    else:
        evals, evecs = torch.linalg.eigh(core)
        top = torch.argsort(evals, descending=True)[:rank]
        lam, U = evals[top].clamp_min(0.0), O @ evecs[:, top]
    d = (diag.double() - U.square() @ lam).clamp_min(damping)
    return LowRankDiag(U=U.float().contiguous(), lam=lam.float(), d=d.float())


# ---------------------------------------------------------------------------- whiteners


class Whitener:
    """A fixed invertible linear map ``S`` applied to gradient rows.

    ``apply(G) = G S`` and ``invert(Z) = Z S^{-1}`` for ``G`` of shape ``(..., dim)``; every
    row uses the same ``S``, so a subset of rows transforms exactly like the same rows of
    the whole. Compute is float32 (bf16/fp16 inputs are upcast); outputs are new float32
    tensors on the input's device. ``to_tensors`` / ``from_tensors`` carry the factors
    (all float32) so one rank can broadcast them and every rank holds bit-identical maps;
    ``tensor_shapes(dim, rank)`` tells receivers what to allocate.
    """

    kind: str = ""

    def __init__(self, dim: int, *, version: int = 0):
        if isinstance(dim, bool) or int(dim) != dim or dim < 1:
            raise ValueError(f"{type(self).__name__} dim must be a positive int, got {dim!r}")
        self.dim = int(dim)
        self.version = int(version)

    # -- subclass hooks
    def _apply_rows(self, g: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement _apply_rows")

    def _invert_rows(self, z: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement _invert_rows")

    def to_tensors(self) -> list[Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not implement to_tensors")

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], *, version: int = 0) -> Whitener:
        raise NotImplementedError(f"{cls.__name__} does not implement from_tensors")

    @classmethod
    def tensor_shapes(cls, dim: int, rank: int = 0) -> list[tuple[int, ...]]:
        raise NotImplementedError(f"{cls.__name__} does not implement tensor_shapes")

    # -- public API
    @property
    def rank(self) -> int:
        return 0

    def apply(self, G: Tensor) -> Tensor:
        """``Z = G S`` row-wise; float32 result of ``G``'s shape."""
        return self._rowwise(G, self._apply_rows)

    def invert(self, Z: Tensor) -> Tensor:
        """``G = Z S^{-1}`` row-wise; float32 result of ``Z``'s shape."""
        return self._rowwise(Z, self._invert_rows)

    @property
    def run_unit(self) -> int:
        """A run given to :meth:`apply_run` must hold whole rows: ``dim`` elements each."""
        return self.dim

    def apply_run(self, values: Tensor, start: int) -> Tensor:
        """``apply`` on a flat run of a row-major parameter starting at element ``start``
        (whole rows only); float32, flat, a new tensor (the reducer packs it without a copy)."""
        return self.apply(self._rows_of_run(values, start)).reshape(-1)

    def invert_run(self, values: Tensor, start: int) -> Tensor:
        return self.invert(self._rows_of_run(values, start)).reshape(-1)

    def _rows_of_run(self, values: Tensor, start: int) -> Tensor:
        if start % self.dim or values.numel() % self.dim:
            raise ValueError(f"{type(self).__name__} transforms whole rows of {self.dim}; got a run of "
                             f"{values.numel()} elements at offset {start}")
        return values.reshape(-1, self.dim)

    def metadata_nbytes(self) -> int:
        """Bytes of :meth:`to_tensors`, i.e. what a factor broadcast puts on the wire."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors())

    def to(self, device: torch.device | str) -> Whitener:
        """A copy with the factors on ``device`` (apply moves them per call otherwise)."""
        return self._rebuild([t.to(device) for t in self.to_tensors()])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, rank={self.rank}, version={self.version})"

    # -- helpers
    def _rebuild(self, tensors: list[Tensor]) -> Whitener:
        return type(self).from_tensors(tensors, version=self.version)

    def _device(self) -> torch.device:
        tensors = self.to_tensors()
        return tensors[0].device if tensors else torch.device("cpu")

    def _rowwise(self, X: Tensor, fn) -> Tensor:
        if X.dim() == 0 or X.shape[-1] != self.dim:
            raise ValueError(f"{type(self).__name__} expects rows of length {self.dim}, got shape {tuple(X.shape)}")
        if not X.is_floating_point():
            raise ValueError(f"{type(self).__name__} expects a floating-point tensor, got {X.dtype}")
        rows = X.reshape(-1, self.dim).to(torch.float32)
        return fn(rows).reshape(X.shape)


def _check_tensor_count(cls, tensors: Sequence[Tensor], n: int) -> None:
    if len(tensors) != n:
        raise ValueError(f"{cls.__name__}.from_tensors expects {n} tensors, got {len(tensors)}")


class StructuredWhitener(Whitener):
    """``S = D^{-1/2} (I + V diag(shrink - 1) V^T)``, ``S^{-1} = (I + V diag(expand) V^T) D^{1/2}``.

    From ``B = D^{-1/2} U diag(lam)^{1/2} = V diag(s) P^T``: ``shrink = (1+s^2)^{-1/2}`` and
    ``expand = (1+s^2)^{1/2} - 1``. Then ``D^{-1/2} A_hat D^{-1/2} = I + V diag(s^2) V^T`` and
    ``S^T A_hat S = I``. Apply and invert cost O(rows * in * r); no ``in x in`` matrix
    is ever formed, neither here nor when the factors are built.
    Wire tensors: ``[d_inv_sqrt (in,), d_sqrt (in,), V (in, r), shrink (r,), expand (r,)]``.
    """

    kind = "structured"

    def __init__(
        self, *, d_inv_sqrt: Tensor, d_sqrt: Tensor, V: Tensor, shrink: Tensor, expand: Tensor, version: int = 0
    ):
        if V.dim() != 2:
            raise ValueError(f"StructuredWhitener expects V of shape (in, r), got {tuple(V.shape)}")
        dim, r = V.shape
        shapes = [tuple(t.shape) for t in (d_inv_sqrt, d_sqrt, V, shrink, expand)]
        if shapes != self.tensor_shapes(dim, r):
            raise ValueError(
                "StructuredWhitener expects d_inv_sqrt (in,), d_sqrt (in,), V (in, r), shrink (r,), expand (r,), "
                f"got {shapes}"
            )
        super().__init__(dim, version=version)
        self.d_inv_sqrt, self.d_sqrt, self.V, self.shrink, self.expand = (
            t.to(_FACTOR_DTYPE) for t in (d_inv_sqrt, d_sqrt, V, shrink, expand)
        )

    @classmethod
    @torch.no_grad()
    def from_low_rank(cls, lrd: LowRankDiag, *, version: int = 0) -> StructuredWhitener:
        d = lrd.d.to(_FIT_DTYPE)
        if not bool((d > 0).all()):
            raise ValueError("StructuredWhitener needs a strictly positive diagonal d (fit with damping > 0)")
        d_inv_sqrt = d.rsqrt()
        if lrd.rank == 0:
            V = d.new_zeros(lrd.dim, 0)
            s2 = d.new_zeros(0)
        else:
            B = lrd.U.to(_FIT_DTYPE) * lrd.lam.to(_FIT_DTYPE).clamp(min=0).sqrt() * d_inv_sqrt[:, None]
            V, s, _ = torch.linalg.svd(B, full_matrices=False)
            s2 = s * s
        root = torch.sqrt(1.0 + s2)
        # s^2 / (1 + root) is (1+s^2)^{1/2} - 1 without cancellation for small s.
        return cls(
            d_inv_sqrt=d_inv_sqrt, d_sqrt=d.sqrt(), V=V, shrink=1.0 / root, expand=s2 / (1.0 + root), version=version
        )

    @property
    def rank(self) -> int:
        return self.V.shape[1]

    def _apply_rows(self, g: Tensor) -> Tensor:
        dev = g.device
        V = self.V.to(dev)
        gp = g * self.d_inv_sqrt.to(dev)
        coef = gp @ V
        # Z = P + coef * shrink V^T with P = gp - coef V^T the part of gp off span(V). When the
        # top directions dominate, P is a small difference of large numbers; the second
        # projection removes the rounding that P keeps along V, which invert would multiply
        # by up to (1+s^2)^{1/2}. One pass would give round-trip error ~ eps * max(s).
        P = torch.addmm(gp, coef, V.T, alpha=-1.0)
        coef.mul_(self.shrink.to(dev)).sub_(P @ V)
        return torch.addmm(P, coef, V.T)

    def _invert_rows(self, z: Tensor) -> Tensor:
        dev = z.device
        V = self.V.to(dev)
        return torch.addmm(z, (z @ V).mul_(self.expand.to(dev)), V.T).mul_(self.d_sqrt.to(dev))

    def to_tensors(self) -> list[Tensor]:
        return [self.d_inv_sqrt, self.d_sqrt, self.V, self.shrink, self.expand]

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], *, version: int = 0) -> StructuredWhitener:
        _check_tensor_count(cls, tensors, 5)
        d_inv_sqrt, d_sqrt, V, shrink, expand = tensors
        return cls(d_inv_sqrt=d_inv_sqrt, d_sqrt=d_sqrt, V=V, shrink=shrink, expand=expand, version=version)

    @classmethod
    def tensor_shapes(cls, dim: int, rank: int = 0) -> list[tuple[int, ...]]:
        return [(dim,), (dim,), (dim, rank), (rank,), (rank,)]


class CholeskyWhitener(Whitener):
    """The published form: ``A_hat = L L^T``, ``S = L^{-T}``; dense, O(rows * in^2) per call.

    Kept for comparison with :class:`StructuredWhitener`. Wire tensors: ``[L (in, in)]``.
    """

    kind = "cholesky"

    def __init__(self, *, L: Tensor, version: int = 0):
        if L.dim() != 2 or L.shape[0] != L.shape[1]:
            raise ValueError(f"CholeskyWhitener expects a square lower-triangular L, got shape {tuple(L.shape)}")
        super().__init__(L.shape[0], version=version)
        self.L = L.to(_FACTOR_DTYPE)

    @classmethod
    @torch.no_grad()
    def from_low_rank(cls, lrd: LowRankDiag, *, version: int = 0) -> CholeskyWhitener:
        U = lrd.U.to(_FIT_DTYPE)
        A_hat = (U * lrd.lam.to(_FIT_DTYPE)) @ U.T
        A_hat.diagonal().add_(lrd.d.to(_FIT_DTYPE))
        return cls(L=torch.linalg.cholesky(A_hat), version=version)

    def _apply_rows(self, g: Tensor) -> Tensor:
        L = self.L.to(g.device)
        # Z L^T = G with L^T upper triangular.
        return torch.linalg.solve_triangular(L.T, g, upper=True, left=False)

    def _invert_rows(self, z: Tensor) -> Tensor:
        return z @ self.L.to(z.device).T

    def to_tensors(self) -> list[Tensor]:
        return [self.L]

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], *, version: int = 0) -> CholeskyWhitener:
        _check_tensor_count(cls, tensors, 1)
        return cls(L=tensors[0], version=version)

    @classmethod
    def tensor_shapes(cls, dim: int, rank: int = 0) -> list[tuple[int, ...]]:
        return [(dim, dim)]


_HADAMARD_CACHE: dict[tuple, Tensor] = {}


def _sylvester(n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The unnormalized Sylvester Hadamard matrix of order ``n`` (a power of two), cached."""
    key = (n, device, dtype)
    h = _HADAMARD_CACHE.get(key)
    if h is None:
        h = torch.ones(1, 1, dtype=dtype, device=device)  # built where it is used: no host copy
        while h.shape[0] < n:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _HADAMARD_CACHE[key] = h
    return h


def _fwht(x: Tensor) -> Tensor:
    """Unnormalized Walsh-Hadamard transform (Sylvester order) along the last dim, a power of two.

    ``H_n = H_a (x) H_b`` with ``a * b = n``: viewing each row as an ``a x b`` matrix ``X``,
    the transform is ``H_a X H_b``, two small matrix products that run as BLAS / tensor-core
    GEMMs, instead of log2(n) butterfly passes (the reference in ``tests/test_geometry.py``) that each read and
    write the whole tensor (2.5-5x faster on CPU for Llama-600M's layers, see
    ``benchmarks/codec_speed.py``). Under TF32 matmuls the rounding is TF32's.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"_fwht needs a power-of-two last dimension, got {n}")
    a = 1 << ((n.bit_length() - 1) // 2)
    y = x.reshape(-1, a, n // a)
    y = torch.matmul(_sylvester(a, x.device, x.dtype), y)
    y = torch.matmul(y, _sylvester(n // a, x.device, x.dtype))  # symmetric, so no transpose
    return y.reshape(x.shape)


def _hadamard_segments(dim: int, block: int | None) -> list[tuple[int, int, int]]:
    """``(start, size, count)`` runs of power-of-two blocks that tile ``[0, dim)``.

    With ``block`` the bulk is ``dim // block`` blocks of that size; what is left (or all
    of ``dim`` when ``block`` is None) is split by its binary digits, largest first.
    """
    segments = []
    start = 0
    if block is not None:
        count = dim // block
        if count:
            segments.append((0, block, count))
            start = block * count
    rest = dim - start
    size = 1 << max(rest.bit_length() - 1, 0)
    while rest:
        if rest & size:
            segments.append((start, size, 1))
            start += size
            rest -= size
        size >>= 1
    return segments


class HadamardWhitener(Whitener):
    """Random-sign block Hadamard rotation ``S = diag(signs) H``, orthonormal, ``S^{-1} = S^T``.

    ``H`` is block diagonal with normalized Walsh-Hadamard blocks tiling ``dim`` (see
    :func:`_hadamard_segments`: power-of-two blocks, so any ``dim`` works). Signs come from
    a CPU generator seeded with ``seed``, so every rank builds the same map without
    communication. Applied with a fast transform, O(rows * in * sqrt(block)) flops as two
    small GEMMs per block (see :func:`_fwht`).
    Wire tensors: ``[signs (in,)]``; the block layout is not on the wire (pass ``block``).
    """

    kind = GeometryKind.HADAMARD

    def __init__(self, dim: int, *, seed: int, block: int | None = None, device=None, version: int = 0):
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed))
        signs = torch.randint(0, 2, (int(dim),), generator=gen).mul_(2).sub_(1).to(_FACTOR_DTYPE)
        self._setup(signs.to(device) if device is not None else signs, block, version)

    def _setup(self, signs: Tensor, block: int | None, version: int) -> None:
        if signs.dim() != 1 or signs.numel() < 1:
            raise ValueError(f"HadamardWhitener expects a non-empty 1-D signs tensor, got shape {tuple(signs.shape)}")
        if block is not None and (not isinstance(block, int) or block < 1 or block & (block - 1)):
            raise ValueError(f"HadamardWhitener block must be a power of two or None, got {block!r}")
        Whitener.__init__(self, signs.numel(), version=version)
        self.signs = signs.to(_FACTOR_DTYPE)
        self.block = block
        self.segments = _hadamard_segments(self.dim, block)
        self._signs_on = {str(self.signs.device): self.signs}  # made on the CPU: one copy per device, once

    def signs_on(self, device) -> Tensor:
        key = str(device)
        if key not in self._signs_on:
            self._signs_on[key] = host_to_device(self.signs, device) if self.signs.device.type == "cpu" \
                else self.signs.to(device)
        return self._signs_on[key]

    def _transform(self, x: Tensor) -> Tensor:
        out = torch.empty_like(x)
        rows = x.shape[0]
        for start, size, count in self.segments:
            stop = start + size * count
            seg = x[:, start:stop].reshape(rows, count, size)
            out[:, start:stop] = _fwht(seg).reshape(rows, size * count).mul_(1.0 / math.sqrt(size))
        return out

    def _apply_rows(self, g: Tensor) -> Tensor:
        return self._transform(g * self.signs_on(g.device))

    def _invert_rows(self, z: Tensor) -> Tensor:
        return self._transform(z).mul_(self.signs_on(z.device))

    def to_tensors(self) -> list[Tensor]:
        return [self.signs]

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], *, block: int | None = None, version: int = 0) -> HadamardWhitener:
        _check_tensor_count(cls, tensors, 1)
        obj = cls.__new__(cls)
        obj._setup(tensors[0], block, version)
        return obj

    def _rebuild(self, tensors: list[Tensor]) -> Whitener:
        return type(self).from_tensors(tensors, block=self.block, version=self.version)

    @classmethod
    def tensor_shapes(cls, dim: int, rank: int = 0) -> list[tuple[int, ...]]:
        return [(dim,)]


class IdentityWhitener(Whitener):
    """``S = I``: the Euclidean baseline. ``apply``/``invert`` return float32 copies."""

    kind = GeometryKind.IDENTITY

    def _apply_rows(self, g: Tensor) -> Tensor:
        return g.clone()

    def _invert_rows(self, z: Tensor) -> Tensor:
        return z.clone()

    def to_tensors(self) -> list[Tensor]:
        return []

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], *, dim: int | None = None, version: int = 0) -> IdentityWhitener:
        _check_tensor_count(cls, tensors, 0)
        if dim is None:
            raise ValueError("IdentityWhitener.from_tensors needs dim= (it carries no tensors)")
        return cls(dim, version=version)

    def _rebuild(self, tensors: list[Tensor]) -> Whitener:
        return self

    def _device(self) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def tensor_shapes(cls, dim: int, rank: int = 0) -> list[tuple[int, ...]]:
        return []


# Data-independent kinds: built once per layer from its input width and a seed, never refitted;
# a kind listed here needs nothing else to be built (lifecycle.GeometryManager builds them all).
FIXED_KINDS: dict[GeometryKind, Callable[[int, int], Transform]] = {
    GeometryKind.HADAMARD: lambda dim, seed: HadamardWhitener(dim, seed=seed),
}


# -------------------------------------------------------------------------- entry points


def whitener_from_low_rank(lrd: LowRankDiag, solver: str = "structured", *, version: int = 0) -> Whitener:
    """Whitener for ``A_hat`` given by ``lrd``; ``solver`` in :data:`SOLVERS`."""
    if solver == "structured":
        return StructuredWhitener.from_low_rank(lrd, version=version)
    if solver == "cholesky":
        return CholeskyWhitener.from_low_rank(lrd, version=version)
    raise ValueError(f"solver {solver!r} not in allowed values {list(SOLVERS)}")


def fit_whitener(
    A: Tensor,
    *,
    rank: int,
    damping: float,
    solver: str = "structured",
    method: str = "by_width",
    seed: int = 0,
    version: int = 0,
) -> Whitener:
    """:func:`fit_low_rank_diag` then :func:`whitener_from_low_rank`."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} not in allowed values {list(SOLVERS)}")
    lrd = fit_low_rank_diag(A, rank=rank, damping=damping, method=method, seed=seed)
    return whitener_from_low_rank(lrd, solver, version=version)


def make_whitener(
    kind: str, dim: int, *, seed: int = 0, block: int | None = None, device=None, version: int = 0
) -> Whitener:
    """Data-independent whiteners: ``"hadamard"`` (seeded random-sign rotation) or ``"identity"``."""
    if kind == GeometryKind.HADAMARD:
        return HadamardWhitener(dim, seed=seed, block=block, device=device, version=version)
    if kind == GeometryKind.IDENTITY:
        return IdentityWhitener(dim, version=version)
    raise ValueError(f"whitener kind {kind!r} not in allowed values ['hadamard', 'identity']")


# ------------------------------------------------------------------------ Adam's geometry

# Row and column means of the second moment below this fraction of its overall mean are
# raised to it: a row that never saw a gradient would otherwise get an unbounded factor.
SCALING_FLOOR = 1e-8


def row_runs(start: int, numel: int, width: int) -> list[tuple[int, int, int, int, int]]:
    """Cut the flat run ``[start, start + numel)`` of a row-major matrix ``width`` wide into
    ``(pos, row, col, length, rows)``: ``rows > 0`` is that many whole rows from ``row``;
    ``rows == 0`` is ``length`` elements of row ``row`` from column ``col`` (a partial row at
    either end). ``pos`` is where the piece starts inside the run."""
    runs = []
    pos = 0
    while pos < numel:
        row, col = divmod(start + pos, width)
        if col == 0 and numel - pos >= width:
            rows = (numel - pos) // width
            runs.append((pos, row, 0, rows * width, rows))
            pos += rows * width
        else:
            length = min(width - col, numel - pos)
            runs.append((pos, row, col, length, 0))
            pos += length
    return runs


@torch.no_grad()
def row_col_sums(values: Tensor, start: int, shape: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Sums over each row and each column of the elements ``values`` holds of a row-major
    ``shape = (out, in)`` matrix, ``values`` being its flat elements ``[start, start + n)``
    (a ZeRO slice). Float64, zeros where the slice has nothing; slices that tile the matrix
    add up to the whole matrix's sums."""
    out_dim, width = int(shape[0]), int(shape[1])
    n = values.numel()
    if start < 0 or start + n > out_dim * width:
        raise ValueError(f"row_col_sums: elements [{start}, {start + n}) are outside a {out_dim} x {width} matrix")
    flat = values.reshape(-1).to(torch.float64)
    rows = torch.zeros(out_dim, dtype=torch.float64, device=values.device)
    cols = torch.zeros(width, dtype=torch.float64, device=values.device)
    for pos, row, col, length, count in row_runs(start, n, width):
        part = flat.narrow(0, pos, length)
        if count:
            block = part.view(count, width)
            rows.narrow(0, row, count).add_(block.sum(1))
            cols.add_(block.sum(0))
        else:
            rows[row] += part.sum()
            cols.narrow(0, col, length).add_(part)
    return rows, cols


class FactoredScaling:
    """Adam's geometry for one ``(out, in)`` weight: ``Z = G * a b^T`` elementwise, ``G = Z / (a b^T)``.

    With ``r``, ``c`` the row and column means of Adam's ``exp_avg_sq`` and ``mu`` its overall
    mean, ``a = sqrt(mu / r)`` and ``b = sqrt(mu / c)``, so ``a_i b_j = mu / sqrt(r_i c_j) =
    sqrt(mu / v_hat_ij)`` with ``v_hat = r c^T / mu`` Adafactor's factorization of ``v``:
    coordinates in which Adam's update ``g / sqrt(v)`` sees the quantization error of every
    element alike, at the gradient's own overall scale. Elementwise, so :meth:`apply_run`
    transforms any run of the flattened weight (``run_unit`` 1). Float32; the inverse
    multiplies by precomputed reciprocals (round trip within a few float32 ulps).
    """

    kind = GeometryKind.ADAM_FACTORED
    run_unit = 1
    rank = 0

    def __init__(self, row: Tensor, col: Tensor, *, version: int = 0):
        if row.dim() != 1 or col.dim() != 1 or not row.numel() or not col.numel():
            raise ValueError(f"FactoredScaling expects non-empty 1-D row (out,) and col (in,) factors, got "
                             f"{tuple(row.shape)} and {tuple(col.shape)}")
        for label, t in (("row", row), ("col", col)):
            if not bool((torch.isfinite(t) & (t > 0)).all()):
                raise ValueError(f"FactoredScaling {label} factors must be positive and finite")
        self.row = row.to(_FACTOR_DTYPE)
        self.col = col.to(_FACTOR_DTYPE)
        self.row_inv = 1.0 / self.row
        self.col_inv = 1.0 / self.col
        self.shape = (self.row.numel(), self.col.numel())
        self.dim = self.shape[1]
        self.version = int(version)

    def apply(self, G: Tensor) -> Tensor:
        """``G * a b^T`` for whole weights: ``G`` holds one or more (a leading batch) of them."""
        return self._whole(G, self.row, self.col)

    def invert(self, Z: Tensor) -> Tensor:
        return self._whole(Z, self.row_inv, self.col_inv)

    def _whole(self, X: Tensor, row: Tensor, col: Tensor) -> Tensor:
        out_dim, width = self.shape
        if X.numel() % (out_dim * width) or not X.numel():
            raise ValueError(f"FactoredScaling of a {out_dim} x {width} weight got a tensor of shape "
                             f"{tuple(X.shape)}")
        weights = X.to(torch.float32).reshape(-1, out_dim, width)
        # the same operations in the same order as _scale on whole rows: the same bits
        scaled = torch.mul(weights, row.to(X.device)[:, None]).mul_(col.to(X.device))
        return scaled.reshape(X.shape)

    def apply_run(self, values: Tensor, start: int) -> Tensor:
        """The scaling of the flat elements ``[start, start + n)`` of the weight; float32, flat, a new tensor."""
        return self._scale(values, start, self.row, self.col)

    def invert_run(self, values: Tensor, start: int) -> Tensor:
        return self._scale(values, start, self.row_inv, self.col_inv)

    def _scale(self, values: Tensor, start: int, row: Tensor, col: Tensor) -> Tensor:
        if start < 0 or start + values.numel() > self.shape[0] * self.shape[1]:
            raise ValueError(f"FactoredScaling: elements [{start}, {start + values.numel()}) are outside the "
                             f"{self.shape[0]} x {self.shape[1]} weight")
        dev = values.device
        row, col = row.to(dev), col.to(dev)
        flat = values.reshape(-1).to(torch.float32)
        out = torch.empty_like(flat)
        for pos, r, c, length, count in row_runs(start, flat.numel(), self.dim):
            src, dst = flat.narrow(0, pos, length), out.narrow(0, pos, length)
            if count:
                torch.mul(src.view(count, self.dim), row.narrow(0, r, count)[:, None], out=dst.view(count, self.dim))
                dst.view(count, self.dim).mul_(col)
            else:
                torch.mul(src, row[r], out=dst).mul_(col.narrow(0, c, length))
        return out

    def to_tensors(self) -> list[Tensor]:
        return [self.row, self.col]

    def metadata_nbytes(self) -> int:
        """Bytes of the row and column sums every rank all-reduces to build this scaling."""
        return (self.shape[0] + self.shape[1]) * 4


def factored_scaling_from_sums(row_sums: Tensor, col_sums: Tensor, *, floor: float = SCALING_FLOOR,
                               version: int = 0) -> FactoredScaling | None:
    """The :class:`FactoredScaling` of a weight from the sums over its rows and columns of
    Adam's ``exp_avg_sq`` (whole-matrix sums, e.g. :func:`row_col_sums` added over ranks).
    None when the second moment is all zero (no optimizer state yet, or a layer that never
    had a gradient): such a layer has no Adam geometry and stays Euclidean."""
    rows, cols = row_sums.to(torch.float64), col_sums.to(torch.float64)
    if rows.dim() != 1 or cols.dim() != 1:
        raise ValueError(f"factored_scaling_from_sums expects 1-D sums, got {tuple(rows.shape)} and {tuple(cols.shape)}")
    if not bool(torch.isfinite(rows).all() and torch.isfinite(cols).all()):
        raise ValueError("factored_scaling_from_sums: the second-moment sums are not finite")
    if bool((rows < 0).any() or (cols < 0).any()):
        raise ValueError("factored_scaling_from_sums: a second moment cannot have negative sums")
    if not (0.0 <= float(floor) < 1.0):
        raise ValueError(f"factored_scaling_from_sums: floor must be in [0, 1), got {floor!r}")
    out_dim, width = rows.numel(), cols.numel()
    mu = float(rows.sum()) / (out_dim * width)
    if not mu > 0:
        return None
    r = (rows / width).clamp_min(floor * mu)
    c = (cols / out_dim).clamp_min(floor * mu)
    return FactoredScaling((mu / r).sqrt(), (mu / c).sqrt(), version=version)


class full_fp32_matmuls:
    """Matrix products in full fp32 inside: a user's TF32 setting (HF ``tf32=True``) would
    round whitening and its inverse to 10 mantissa bits, ~1e-3 on the round trip, above the
    codec's own error at bf16/fp32. The setting is the process's: with ranks as threads
    (``comm.LocalComm``) the first to enter sets it and the last to leave restores it.

    PyTorch has two APIs for it, and reading the legacy one after the new one was used raises
    (transformers 5 sets ``torch.backends.fp32_precision = "tf32"`` for ``tf32=True``). So the
    guard speaks the API the process already speaks: the legacy one where its getter answers,
    else the new one's matmul backends (CUDA's and oneDNN's), set to "ieee" and put back as
    they were."""

    _lock = threading.Lock()
    _inside = 0
    _saved: object = "highest"
    NEW_API_BACKENDS = ("cuda", "mkldnn")

    @classmethod
    def _new_api(cls):
        backends = (getattr(torch.backends, name, None) for name in cls.NEW_API_BACKENDS)
        return [b.matmul for b in backends if hasattr(getattr(b, "matmul", None), "fp32_precision")]

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._inside == 0:
                try:
                    cls._saved = torch.get_float32_matmul_precision()
                    if cls._saved != "highest":
                        torch.set_float32_matmul_precision("highest")
                except RuntimeError:  # the new API is in use: the legacy getter refuses to answer
                    cls._saved = [m.fp32_precision for m in cls._new_api()]
                    for m in cls._new_api():
                        m.fp32_precision = "ieee"
            cls._inside += 1
        return self

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._inside -= 1
            if cls._inside == 0:
                if isinstance(cls._saved, list):
                    for m, value in zip(cls._new_api(), cls._saved):
                        m.fp32_precision = value
                elif cls._saved != "highest":
                    torch.set_float32_matmul_precision(cls._saved)
        return False
