"""Tests for deepspeed_gift.core.geometry: statistics, low-rank fits and whitening transforms."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepspeed_gift.core.geometry import (
    AUTO_EIGH_MAX_DIM,
    CovarianceEMA,
    HadamardWhitener,
    IdentityWhitener,
    LowRankDiag,
    StructuredWhitener,
    blend_low_rank,
    fit_low_rank_diag,
    factored_scaling_from_sums,
    fit_whitener,
    low_rank_to_dense,
    make_whitener,
    row_col_sums,
    second_moment,
    whitener_from_low_rank,
    CholeskyWhitener,
    GeometryKind,
    Whitener,
)


def dense_matrix(w: Whitener) -> torch.Tensor:
    """``S`` as a dense ``(dim, dim)`` matrix: ``apply`` of the identity."""
    return w.apply(torch.eye(w.dim))


def dense_inverse(w: Whitener) -> torch.Tensor:
    """``S^{-1}`` as a dense ``(dim, dim)`` matrix."""
    return w.invert(torch.eye(w.dim))


def whitener_from_tensors(kind, tensors, *, dim=None, block=None, version=0) -> Whitener:
    """A whitener rebuilt from its ``to_tensors`` (``dim`` for identity, ``block`` for Hadamard)."""
    if kind == GeometryKind.IDENTITY:
        return IdentityWhitener.from_tensors(tensors, dim=dim, version=version)
    if kind == GeometryKind.HADAMARD:
        return HadamardWhitener.from_tensors(tensors, block=block, version=version)
    return {"structured": StructuredWhitener, "cholesky": CholeskyWhitener}[kind].from_tensors(tensors, version=version)

F32_EPS = torch.finfo(torch.float32).eps
# invert(apply(G)) in fp32: both transforms contract rows against length-`in` vectors, and
# rounding in such dot products grows like sqrt(in) * eps (probabilistic bound). Measured
# at most ~6 sqrt(in) eps over 10 seeds, whatever the conditioning of S: the
# structured form re-projects off span(V), the Cholesky form pairs a backward-stable solve
# with a product by the same factor.
def roundtrip_rtol(dim: int) -> float:
    return 8 * math.sqrt(dim) * F32_EPS


# A subset of rows may go through BLAS kernels blocked differently from the full matrix,
# so equal up to a few fp32 roundings, not bitwise.
SUBSET_RTOL = 1e-5
# ||S^T A_hat S - I||_F / sqrt(in) with S stored in fp32 and A_hat condition ~1e7 (measured <= 3e-5).
WHITEN_TOL = 1e-3
DAMPING = 1e-3
RANK = 8


# ------------------------------------------------------------------------------ helpers


def _anisotropic_cov(dim: int, *, seed: int = 0, lowrank_dims: int = 4) -> torch.Tensor:
    """Covariance shaped like LLM layer inputs: log-normal channel scales, a few massive
    channels (x20), a few strongly correlated directions. float64."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(dim, generator=gen, dtype=torch.float64))
    massive = torch.randperm(dim, generator=gen)[: max(1, dim // 64)]
    scales[massive] *= 20.0
    W = 3.0 * torch.randn(dim, lowrank_dims, generator=gen, dtype=torch.float64)
    C = W @ W.T + torch.eye(dim, dtype=torch.float64)
    return scales[:, None] * C * scales[None, :]


def _rows_with_cov(A: torch.Tensor, rows: int, *, seed: int = 1) -> torch.Tensor:
    """fp32 rows drawn from N(0, A)."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(rows, A.shape[0], generator=gen, dtype=torch.float64)
    return (noise @ torch.linalg.cholesky(A).T).float()


def _block_quantize(x: torch.Tensor, *, block: int = 32, bits: int = 8) -> torch.Tensor:
    """Symmetric uniform quantize-dequantize with one absmax scale per `block` elements of a row."""
    rows, n = x.shape
    levels = 2 ** (bits - 1) - 1
    padded = torch.nn.functional.pad(x, (0, (-n) % block)).reshape(rows, -1, block)
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=1e-30) / levels
    return (torch.round(padded / scale) * scale).reshape(rows, -1)[:, :n]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cond(cov: torch.Tensor) -> float:
    ev = torch.linalg.eigvalsh(cov.double())
    return float(ev[-1] / ev[0])


def _whitener(kind: str, dim: int, *, seed: int = 0):
    if kind in ("hadamard", "identity"):
        return make_whitener(kind, dim, seed=seed)
    A = _anisotropic_cov(dim, seed=seed).float()
    method = "randomized" if dim > AUTO_EIGH_MAX_DIM else "eigh"
    return fit_whitener(A, rank=min(RANK, dim), damping=DAMPING, solver=kind, method=method, seed=seed)


KINDS = ["structured", "cholesky", "hadamard", "identity"]
SOLVERS = ["structured", "cholesky"]


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dim", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("kind", KINDS)
def test_invert_undoes_apply(kind, dim):
    w = _whitener(kind, dim)
    G = _rows_with_cov(_anisotropic_cov(dim, seed=3), 33)
    Z = w.apply(G)
    assert Z.dtype == torch.float32 and Z.shape == G.shape
    assert _rel(w.invert(Z), G) <= roundtrip_rtol(dim)
    # and the other way round: S^{-1} then S
    assert _rel(w.apply(w.invert(G)), G) <= roundtrip_rtol(dim)


@pytest.mark.parametrize("solver", SOLVERS)
def test_round_trip_does_not_degrade_with_conditioning(solver):
    # one direction 1e9 x the damping: (1+s^2)^{1/2} ~ 3e4. A single projection in the
    # structured apply would leave round-trip error ~ eps * 3e4 here.
    dim = 64
    gen = torch.Generator().manual_seed(2)
    u = torch.nn.functional.normalize(torch.randn(dim, generator=gen, dtype=torch.float64), dim=0)
    A = _anisotropic_cov(dim) + 1e6 * torch.outer(u, u)
    w = fit_whitener(A.float(), rank=RANK, damping=DAMPING, solver=solver)
    G = _rows_with_cov(A, 64)
    assert _rel(w.invert(w.apply(G)), G) <= roundtrip_rtol(dim)


@pytest.mark.parametrize("dim", [7, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_row_subsets_match_full_apply(kind, dim):
    w = _whitener(kind, dim)
    G = _rows_with_cov(_anisotropic_cov(dim, seed=3), 40)
    Z = w.apply(G)
    for idx in (slice(0, 1), slice(5, 17), torch.tensor([39, 2, 11])):
        torch.testing.assert_close(w.apply(G[idx]), Z[idx], rtol=SUBSET_RTOL, atol=SUBSET_RTOL * float(Z.abs().max()))
        torch.testing.assert_close(
            w.invert(Z[idx]), w.invert(Z)[idx], rtol=SUBSET_RTOL, atol=SUBSET_RTOL * float(G.abs().max())
        )
    assert w.apply(G[:0]).shape == (0, dim)
    assert w.invert(Z[:0]).shape == (0, dim)


@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_and_batched_inputs(kind):
    dim = 64
    w = _whitener(kind, dim)
    G = _rows_with_cov(_anisotropic_cov(dim, seed=3), 12)
    G_bf16 = G.to(torch.bfloat16)
    Z = w.apply(G_bf16)
    assert Z.dtype == torch.float32
    assert torch.equal(Z, w.apply(G_bf16.float()))
    batched = w.apply(G.reshape(3, 4, dim))
    assert batched.shape == (3, 4, dim)
    torch.testing.assert_close(batched.reshape(12, dim), w.apply(G), rtol=SUBSET_RTOL, atol=1e-6)
    with pytest.raises(ValueError, match="rows of length 64"):
        w.apply(G[:, :10])


# -------------------------------------------------------------------- whitening quality


@pytest.mark.parametrize("dim", [64, 300])
@pytest.mark.parametrize("solver", SOLVERS)
def test_whitens_the_fitted_covariance(solver, dim):
    A = _anisotropic_cov(dim).float()
    lrd = fit_low_rank_diag(A, rank=RANK, damping=DAMPING)
    w = whitener_from_low_rank(lrd, solver)
    S = dense_matrix(w).double()
    A_hat = low_rank_to_dense(lrd).double()
    err = (S.T @ A_hat @ S - torch.eye(dim, dtype=torch.float64)).norm() / math.sqrt(dim)
    assert err <= WHITEN_TOL
    inverse_err = (S @ dense_inverse(w).double() - torch.eye(dim, dtype=torch.float64)).norm() / math.sqrt(dim)
    assert inverse_err <= roundtrip_rtol(dim)


@pytest.mark.parametrize("solver", SOLVERS)
def test_whitened_rows_are_near_isotropic(solver):
    dim, rows = 64, 8192
    A = _anisotropic_cov(dim)
    w = fit_whitener(A.float(), rank=RANK, damping=DAMPING, solver=solver)
    S = dense_matrix(w).double()
    # population covariance of Z rows: S^T A S (A_hat only approximates A, so not exactly I)
    assert _cond(S.T @ A @ S) < 15.0  # 7.8 here, at most 9.6 over 10 seeds
    G = _rows_with_cov(A, rows)
    Z = w.apply(G)
    cond_G, cond_Z = _cond(torch.cov(G.double().T)), _cond(torch.cov(Z.double().T))
    assert cond_G > 1e5
    # 64 dims from 8192 samples adds a factor ~1.4 of sampling spread on top of the population value.
    assert cond_Z < 20.0


def test_structured_and_cholesky_differ_by_a_rotation():
    dim, rows = 300, 4096
    A = _anisotropic_cov(dim)
    lrd = fit_low_rank_diag(A.float(), rank=RANK, damping=DAMPING)
    ws = whitener_from_low_rank(lrd, "structured")
    wc = whitener_from_low_rank(lrd, "cholesky")
    # both satisfy S^T A_hat S = I, so S_c^{-1} S_s is orthogonal
    R = dense_inverse(wc).double() @ dense_matrix(ws).double()
    assert (R.T @ R - torch.eye(dim, dtype=torch.float64)).norm() / math.sqrt(dim) < WHITEN_TOL
    G = _rows_with_cov(A, rows)
    cond_s = _cond(torch.cov(ws.apply(G).double().T))
    cond_c = _cond(torch.cov(wc.apply(G).double().T))
    assert abs(cond_s / cond_c - 1.0) < 0.02


@pytest.mark.parametrize("dim", [64, 300])
@pytest.mark.parametrize("solver", SOLVERS)
def test_quantizing_in_whitened_coordinates_lowers_error(solver, dim):
    A = _anisotropic_cov(dim)
    w = fit_whitener(A.float(), rank=RANK, damping=DAMPING, solver=solver)
    G = _rows_with_cov(A, 1024)
    euclidean = _rel(_block_quantize(G), G)
    whitened = _rel(w.invert(_block_quantize(w.apply(G))), G)
    # channel scales spread within a block set the absmax scale in Euclidean coordinates;
    # whitened rows are isotropic. Measured ratio 0.5 here, at most 0.74 over 10 seeds.
    assert whitened < 0.8 * euclidean


# ---------------------------------------------------------------------- low-rank fits


def _planted(dim: int, top: list[float], *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    rest = 0.1 + 0.9 * torch.rand(dim - len(top), generator=gen, dtype=torch.float64)
    lam = torch.cat([torch.tensor(top, dtype=torch.float64), rest])
    return (Q * lam) @ Q.T, Q


def test_eigh_recovers_planted_eigenpairs():
    top = [40.0, 20.0, 10.0, 5.0]
    A, Q = _planted(50, top)
    lrd = fit_low_rank_diag(A.float(), rank=4, damping=DAMPING, method="eigh")
    assert lrd.U.dtype == lrd.lam.dtype == lrd.d.dtype == torch.float32
    torch.testing.assert_close(lrd.lam.double(), torch.tensor(top, dtype=torch.float64), rtol=1e-5, atol=0)
    overlap = (lrd.U.double().T @ Q[:, :4]).abs()
    torch.testing.assert_close(overlap, torch.eye(4, dtype=torch.float64), atol=1e-5, rtol=0)
    expected_d = A.diagonal() - (Q[:, :4] ** 2) @ torch.tensor(top, dtype=torch.float64)
    torch.testing.assert_close(lrd.d.double(), expected_d.clamp(min=DAMPING), atol=1e-5, rtol=1e-5)


def test_randomized_matches_eigh_on_top_subspace():
    dim, r = 300, RANK
    A, _ = _planted(dim, [100.0 - 10.0 * i for i in range(r)])
    exact = fit_low_rank_diag(A.float(), rank=r, damping=DAMPING, method="eigh")
    approx = fit_low_rank_diag(A.float(), rank=r, damping=DAMPING, method="randomized")
    cosines = torch.linalg.svdvals(exact.U.double().T @ approx.U.double())
    largest_sine = float(torch.sqrt((1.0 - cosines.min() ** 2).clamp(min=0)))
    assert largest_sine < 1e-3
    torch.testing.assert_close(approx.lam, exact.lam, rtol=1e-5, atol=0)
    # d = diag(A) - sum_j lam_j u_j^2 moves by ~lam_max * sine: looser than the subspace itself.
    torch.testing.assert_close(approx.d, exact.d, rtol=1e-3, atol=1e-5)
    auto = fit_low_rank_diag(A.float(), rank=r, damping=DAMPING)
    assert torch.equal(auto.U, exact.U)  # dim <= AUTO_EIGH_MAX_DIM picks eigh


def test_auto_uses_randomized_above_threshold():
    dim = AUTO_EIGH_MAX_DIM + 1
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(dim, 4, generator=gen)
    A = W @ W.T + torch.diag(torch.rand(dim, generator=gen))
    auto = fit_low_rank_diag(A, rank=4, damping=DAMPING, seed=5)
    randomized = fit_low_rank_diag(A, rank=4, damping=DAMPING, method="randomized", seed=5)
    assert torch.equal(auto.U, randomized.U) and torch.equal(auto.d, randomized.d)


def test_residual_diagonal_is_damped_and_eigenvalues_nonnegative():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(40, 3, generator=gen)
    lrd = fit_low_rank_diag(W @ W.T, rank=3, damping=DAMPING)  # residual is ~0
    assert bool((lrd.d >= DAMPING).all())
    negative = fit_low_rank_diag(-torch.eye(10) + 0.1 * torch.ones(10, 10), rank=2, damping=DAMPING)
    assert bool((negative.lam >= 0).all()) and bool((negative.d >= DAMPING).all())


def test_rank_zero_is_diagonal_whitening():
    A = _anisotropic_cov(20).float()
    w = fit_whitener(A, rank=0, damping=DAMPING)
    torch.testing.assert_close(dense_matrix(w), torch.diag(A.diagonal().rsqrt()), rtol=1e-6, atol=0)


def test_invalid_arguments_are_reported():
    A = torch.eye(6)
    with pytest.raises(ValueError, match=r"rank 7 exceeds the layer input dimension 6"):
        fit_low_rank_diag(A, rank=7, damping=DAMPING)
    with pytest.raises(ValueError, match=r"'qr'.*\['by_width', 'eigh', 'randomized'\]"):
        fit_low_rank_diag(A, rank=2, damping=DAMPING, method="qr")
    with pytest.raises(ValueError, match=r"'lu'.*\['structured', 'cholesky'\]"):
        fit_whitener(A, rank=2, damping=DAMPING, solver="lu")
    with pytest.raises(ValueError, match=r"'kfac'.*\['hadamard', 'identity'\]"):
        make_whitener("kfac", 6)
    with pytest.raises(ValueError, match="damping"):
        fit_low_rank_diag(A, rank=2, damping=0.0)
    with pytest.raises(ValueError, match="non-finite"):
        fit_low_rank_diag(torch.full((3, 3), float("nan")), rank=1, damping=DAMPING)
    with pytest.raises(ValueError, match="power of two"):
        HadamardWhitener(8, seed=0, block=6)


def test_blend_and_dense():
    A_prev = _anisotropic_cov(30, seed=1).float()
    A_new = _anisotropic_cov(30, seed=2).float()
    prev = fit_low_rank_diag(A_prev, rank=4, damping=DAMPING)
    dense = low_rank_to_dense(prev)
    U = prev.U.double()
    expected = (U * prev.lam.double()) @ U.T + torch.diag(prev.d.double())
    torch.testing.assert_close(dense.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(blend_low_rank(None, A_new, factor_decay=0.95), A_new)
    torch.testing.assert_close(blend_low_rank(prev, A_new, factor_decay=0.95), 0.95 * dense + 0.05 * A_new)


# --------------------------------------------------------------------------- Hadamard


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(n)


def _reference_hadamard(w: HadamardWhitener) -> torch.Tensor:
    """diag(signs) @ blockdiag(normalized Sylvester blocks), written out densely."""
    blocks = []
    for _, size, count in w.segments:
        blocks += [_sylvester(size)] * count
    return torch.diag(w.signs.double()) @ torch.block_diag(*blocks)


@pytest.mark.parametrize("block", [None, 4, 128])
@pytest.mark.parametrize("dim", [1, 7, 12, 300, 1024])
def test_hadamard_is_orthonormal_and_matches_reference(dim, block):
    w = HadamardWhitener(dim, seed=5, block=block)
    S = dense_matrix(w).double()
    torch.testing.assert_close(S.T @ S, torch.eye(dim, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(S, _reference_hadamard(w), atol=1e-7, rtol=0)
    assert sum(size * count for _, size, count in w.segments) == dim


@pytest.mark.parametrize("n", [1, 2, 8, 32, 512, 2048])
def test_fast_hadamard_transform_matches_the_butterfly(n):
    from deepspeed_gift.core.geometry import _fwht

    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    torch.testing.assert_close(_fwht(x), _fwht_reference(x), atol=1e-10, rtol=0)
    torch.testing.assert_close(_fwht(x.float()), _fwht_reference(x).float(), atol=2e-5 * n ** 0.5, rtol=1e-5)


def test_hadamard_mixes_every_channel_for_power_of_two_dim():
    S = dense_matrix(HadamardWhitener(256, seed=0))
    torch.testing.assert_close(S.abs(), torch.full((256, 256), 1 / 16.0))


def test_hadamard_depends_on_seed_only():
    a = dense_matrix(HadamardWhitener(300, seed=11))
    b = dense_matrix(HadamardWhitener(300, seed=11))
    c = dense_matrix(HadamardWhitener(300, seed=12))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ---------------------------------------------------------------------- determinism


@pytest.mark.parametrize("method", ["eigh", "randomized"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_fits_are_bit_identical(solver, method):
    A = _anisotropic_cov(200).float()
    w1 = fit_whitener(A, rank=RANK, damping=DAMPING, solver=solver, method=method, seed=3)
    w2 = fit_whitener(A.clone(), rank=RANK, damping=DAMPING, solver=solver, method=method, seed=3)
    for t1, t2 in zip(w1.to_tensors(), w2.to_tensors(), strict=True):
        assert torch.equal(t1, t2)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_round_trip_gives_identical_transforms(kind):
    dim = 96
    w = _whitener(kind, dim)
    w.version = 7
    tensors = [t.clone() for t in w.to_tensors()]
    assert all(t.dtype == torch.float32 for t in tensors)
    assert [tuple(t.shape) for t in tensors] == type(w).tensor_shapes(dim, w.rank)
    assert w.metadata_nbytes() == sum(t.numel() * 4 for t in tensors)
    clone = whitener_from_tensors(w.kind, tensors, dim=dim, version=w.version)
    assert type(clone) is type(w) and clone.version == 7 and clone.dim == dim
    G = _rows_with_cov(_anisotropic_cov(dim, seed=4), 9)
    assert torch.equal(clone.apply(G), w.apply(G))
    assert torch.equal(clone.invert(G), w.invert(G))
    assert torch.equal(w.to("cpu").apply(G), w.apply(G))


def test_metadata_sizes():
    dim, r = 128, RANK
    w = _whitener("structured", dim)
    assert w.metadata_nbytes() == 4 * (2 * dim + dim * r + 2 * r)
    assert _whitener("cholesky", dim).metadata_nbytes() == 4 * dim * dim
    assert IdentityWhitener(dim).metadata_nbytes() == 0


# ------------------------------------------------------------------------------ cost


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_structured_path_never_forms_an_in_by_in_matrix():
    dim, r, rows = 8192, 32, 4
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(dim, r, generator=gen))
    lrd = LowRankDiag(U=U, lam=torch.linspace(100.0, 1.0, r), d=0.5 + torch.rand(dim, generator=gen))
    G = torch.randn(rows, dim, generator=gen)
    with _LargestOutput() as mode:
        w = StructuredWhitener.from_low_rank(lrd)
        back = w.invert(w.apply(G))
    assert mode.largest <= max(rows, r) * dim
    assert _rel(back, G) <= roundtrip_rtol(dim)


# ------------------------------------------------------------------------ statistics


def test_covariance_ema_matches_hand_computed_average():
    dim, decay = 6, 0.9
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 5, dim, generator=gen) * (i + 1) for i in range(3)]
    ema = CovarianceEMA(dim, decay=decay)
    for x in batches:
        ema.update(x.to(torch.bfloat16))
    moments = []
    for x in batches:
        rows = x.to(torch.bfloat16).double().reshape(-1, dim)
        moments.append(rows.T @ rows / rows.shape[0])
    expected = moments[0]
    for m in moments[1:]:
        expected = decay * expected + (1 - decay) * m
    assert ema.count == 3
    assert ema.value().dtype == torch.float32
    torch.testing.assert_close(ema.value().double(), expected, rtol=1e-5, atol=1e-6)


def test_update_from_moment_equals_update_and_state_round_trips():
    dim = 5
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(7, dim, generator=gen) for _ in range(3)]
    direct, via_moment = CovarianceEMA(dim, decay=0.95), CovarianceEMA(dim, decay=0.95)
    for x in batches:
        direct.update(x)
        via_moment.update_from_moment(second_moment(x))
    assert torch.equal(direct.value(), via_moment.value())
    restored = CovarianceEMA(dim, decay=0.95)
    restored.load_state_dict(direct.state_dict())
    assert restored.count == 3 and torch.equal(restored.value(), direct.value())
    with pytest.raises(ValueError, match=r"\(\.\.\., 5\)"):
        direct.update(torch.randn(3, 4))
    with pytest.raises(RuntimeError):
        CovarianceEMA(dim, decay=0.9).value()
    with pytest.raises(ValueError, match="decay"):
        CovarianceEMA(dim, decay=1.0)


def test_nystrom_sketch_recovers_the_top_subspace_and_diagonal():
    from deepspeed_gift.core import geometry

    # A = planted rank-4 signal (eigenvalues 100..40) + diagonal noise: one sketch with 12
    # columns sees the top-4 subspace almost exactly (spectral gap ~ 40x).
    dim, rank = 200, 4
    g = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(dim, rank, generator=g, dtype=torch.float64)).Q
    A = basis @ torch.diag(torch.tensor([100.0, 80.0, 60.0, 40.0], dtype=torch.float64)) @ basis.T
    A += torch.diag(torch.rand(dim, generator=g, dtype=torch.float64) + 0.5)
    A = A.float()
    omega = torch.linalg.qr(torch.randn(dim, rank + 8, generator=g, dtype=torch.float64)).Q.float()
    cold = geometry.nystrom_low_rank_diag(omega, A @ omega, torch.diagonal(A), rank=rank, damping=1e-3)
    omega = torch.linalg.qr(A @ omega).Q  # one power step, as the first refresh does
    lrd = geometry.nystrom_low_rank_diag(omega, A @ omega, torch.diagonal(A), rank=rank, damping=1e-3)
    exact = geometry.fit_low_rank_diag(A, rank=rank, damping=1e-3, method="eigh")
    assert (cold.lam < 0.95 * exact.lam).any()  # a random test matrix alone underestimates
    overlap = torch.linalg.svdvals(lrd.U.double().T @ exact.U.double())
    assert overlap.min() > 0.99  # cosine of the largest principal angle
    torch.testing.assert_close(lrd.lam, exact.lam, rtol=1e-3, atol=0.0)
    assert (lrd.d >= 1e-3).all()
    dense = geometry.low_rank_to_dense(lrd)
    torch.testing.assert_close(torch.diagonal(dense), torch.diagonal(A), rtol=1e-4, atol=1e-4)
    Q = torch.randn(dim, 3, generator=g)
    torch.testing.assert_close(geometry.low_rank_matmul(lrd, Q), dense @ Q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(geometry.low_rank_diagonal(lrd), torch.diagonal(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS + ["adam_factored"])
def test_runs_come_back_in_buffers_of_their_own(kind):
    # The reducer packs a one-piece section straight from apply_run / invert_run and then
    # adds to it in place: a result that aliased the bucket would corrupt the gradients.
    dim = 16
    if kind == "adam_factored":
        v = torch.rand(4, dim, generator=torch.Generator().manual_seed(0)) + 0.1
        w = factored_scaling_from_sums(*row_col_sums(v.reshape(-1), 0, v.shape))
    else:
        w = _whitener(kind, dim)
    values = torch.randn(4 * dim, generator=torch.Generator().manual_seed(1))
    before = values.clone()
    for run in (w.apply_run(values, 0), w.invert_run(values, 0)):
        run.add_(1.0)
        assert torch.equal(values, before) and run.dtype == torch.float32


def test_every_transform_kind_keeps_the_transform_contract():
    from deepspeed_gift.core import geometry as geo

    # the reduction uses transforms only through geo.Transform: a run of whole units in, the
    # same run out, inverted back, with the version they were built with
    torch.manual_seed(0)
    dim, rows = 16, 6
    x = torch.randn(200, dim) * torch.linspace(0.1, 3.0, dim)
    lrd = geo.fit_low_rank_diag(x.T @ x / 200, rank=4, damping=1e-3)
    kinds = {
        "structured": geo.whitener_from_low_rank(lrd, "structured", version=3),
        "cholesky": geo.whitener_from_low_rank(lrd, "cholesky", version=3),
        "hadamard": geo.make_whitener("hadamard", dim, seed=1, version=3),
        "identity": geo.make_whitener("identity", dim, version=3),
        "adam_factored": geo.FactoredScaling(torch.rand(rows) + 0.5, torch.rand(dim) + 0.5, version=3),
    }
    flat = torch.randn(rows * dim)
    for name, t in kinds.items():
        assert isinstance(t, geo.Transform), name
        assert t.version == 3 and t.run_unit == (1 if name == "adam_factored" else dim), name
        start, n = 2 * dim, 3 * dim  # rows 2-4 of the weight, as a ZeRO slice would hand them
        run = flat[start:start + n]
        moved = t.apply_run(run, start)
        assert moved.shape == run.shape
        if name != "identity":
            assert not torch.allclose(moved, run), name
        torch.testing.assert_close(t.invert_run(moved, start), run, rtol=1e-5, atol=1e-5)
        assert all(isinstance(v, torch.Tensor) for v in t.to_tensors()), name


def _fwht_reference(x: torch.Tensor) -> torch.Tensor:
    """Slow reference of ``geometry._fwht``: the butterfly, one pass per power of two."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        x = x.reshape(*lead, n // (2 * h), 2, h)
        lo, hi = x[..., 0, :], x[..., 1, :]
        x = torch.stack((lo + hi, lo - hi), dim=-2)
        h *= 2
    return x.reshape(*lead, n)
