"""The attention modifiers beyond ``causal``, as both backends receive them.

The API checks the user's options (`_validate`), resolves them into one `Modifiers`
value with every array already on the backend's side and in the compact 4-D form below,
and hands it to the backend next to ``scale`` and ``causal``. Neither backend sees the
user's layouts or broadcasting rules; both read the same fields.

Semantics (the NumPy backend, the kernels and the float64 test oracle all follow this).
For batch entry ``b`` (a sequence, for varlen), query head ``h``, query row ``i`` and key
column ``j``, with ``nq``, ``nk`` the lengths of that batch entry (the arrays' N, or a
varlen sequence's own lengths) and ``off = nk - nq`` (bottom-right alignment):

(A call may instead be one (query chunk, key chunk) pair of a larger problem: the
streamed path, `cupyflash.streaming`, runs each pair as a call of its own. ``row0`` and
``key0`` are then the problem's indices of the call's row 0 and key 0 and ``diagonal`` the
problem's ``Nk - Nq``: the call's ``off`` is ``diagonal + row0 - key0``, so the band and
ALiBi below are the problem's, and dropout draws the bits of the problem's row
``row0 + i`` and key ``key0 + j``. `Modifiers.call_diagonal` is that ``off``.)

visibility, all of:
    ``i < nq`` and ``j < key_stop``, where ``key_stop`` is ``seqlens_k[b]`` when given,
    else ``nk``. (``seqlens_k`` is a key-padding mask: it hides keys, it does not move
    the causal or window alignment, which uses ``nk``.)
    causal: ``j <= i + off``;
    window ``(left, right)``: ``j >= i + off - left`` when ``left >= 0`` and
    ``j <= i + off + right`` when ``right >= 0``; -1 is unbounded on that side. Causal and
    a window combine as both constraints (so causal wins over right >= 0, as in flash-attn);
    block-sparse: ``block_mask[b, h, i // block_q, j // block_k]`` nonzero.
score (natural units), in this order:
    ``x = scale * q_i . k_j``;
    softcap > 0: ``x = softcap * tanh(x / softcap)``;
    bias: ``x += bias[b, h, i, j]``;
    alibi: ``x += -alibi_slopes[b, h] * |i + off - j|``.
probabilities:
    ``P = softmax over the visible j`` (a row with none: output 0, LSE -inf); the LSE is
    that of ``P``, before dropout.
dropout:
    ``o_i = sum_j P_ij * keep_ij * c * v_j`` with ``c = _philox.dropout_scale(dropout_p)``
    (``1 / (1 - p)`` at the drawn p, a multiple of 1/256) and ``keep_ij =
    _philox.dropout_keep(seed, rng_offset, b, h, i, j, p=dropout_p, heads=Hq)`` (rows and
    columns counted from the start of the batch entry's own sequence).
gradients:
    ``dP_ij = keep_ij c * do_i . v_j``, ``D_i = do_i . o_i``,
    ``dS_ij = P_ij (dP_ij - D_i)`` (d loss / d x_ij);
    ``dbias`` = dS summed over the axes the bias broadcasts over;
    through softcap: ``dS_ij * (1 - tanh^2(x_raw / softcap))`` with ``x_raw = scale q.k``;
    ``dq_i = scale * sum_j dS'_ij k_j``, ``dk_j = scale * sum_i dS'_ij q_i``,
    ``dv_j = sum_i P_ij keep_ij c do_i``. The ALiBi slopes get no gradient.

Compact arrays (never broadcast in memory; a size-1 axis broadcasts):
    block_mask   (Bm, Hm, ceil(Nq / block_q), ceil(Nk / block_k)) uint8, C-contiguous,
                 Bm in {1, B}, Hm in {1, Hq};
    bias         (Bb, Hb, Nqb, Nkb) in the input dtype, each axis 1 or full
                 (B, Hq, Nq, Nk); any strides with a contiguous last axis if Nkb > 1;
    alibi_slopes (Ba, Hq) in the accumulation dtype, C-contiguous, Ba in {1, B};
    cu_seqlens_q, cu_seqlens_k  (S + 1,) int32, C-contiguous: varlen; q, k, v are then
                 (1, H, total, d) views and B = S;
    seqlens_k    (B,) int32, C-contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass


# row0 and key0 are multiples of this: the kernels draw dropout in blocks of 16 rows x 32
# keys (kernels_cu/philox.cuh dropout_counter_base), so an aligned origin adds to the Philox
# counters and leaves a tile's arithmetic as it is. The streamed path's chunks are
# multiples of 128.
ORIGIN_ALIGN = 32


@dataclass(frozen=True)
class Modifiers:
    """Every option beyond ``scale`` and ``causal``, resolved for one call.

    ``Modifiers()`` is plain attention; `active` says whether anything is switched on
    (the GPU backend then runs its general kernels instead of the dense fast path).
    """

    window: tuple = (-1, -1)        # (left, right) as given; -1 unbounded
    softcap: float = 0.0            # 0: off
    dropout_p: float = 0.0
    seed: int = 0                   # Philox key, [0, 2**64)
    rng_offset: int = 0             # first Philox stream of this call, [0, 2**64)
    block_mask: object = None       # see the module docstring for the compact shapes
    block_size: tuple = (128, 128)  # (block_q, block_k) of block_mask
    bias: object = None
    alibi_slopes: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    max_seqlen_q: int = 0           # varlen: longest sequence, sizes the grid
    max_seqlen_k: int = 0
    seqlens_k: object = None
    # precision="tf32": fp32 products may run as one TF32 product (not an option: `active`
    # leaves it out; the GPU forward's kernel mode carries it).
    tf32: bool = False
    # Where the call lies in a larger problem (the module docstring): None for a call that
    # is its own problem. row0 and key0 are multiples of `ORIGIN_ALIGN`.
    diagonal: int | None = None
    row0: int = 0
    key0: int = 0

    def __post_init__(self):
        # The streamed path sets these, never a user; the checks hold the contract: the
        # kernels' dropout counts on aligned origins (kernels_cu/params.cuh), and varlen
        # sequences are always their own problems.
        if self.diagonal is None and (self.row0 or self.key0):
            raise ValueError("row0 and key0 place a call in a larger problem, which needs its diagonal")
        if self.row0 % ORIGIN_ALIGN or self.key0 % ORIGIN_ALIGN or min(self.row0, self.key0) < 0:
            raise ValueError(f"row0 and key0 must be non-negative multiples of {ORIGIN_ALIGN}, "
                             f"got {self.row0} and {self.key0}")
        # The contract's fields are 32-bit (kernels_cu/params.cuh).
        if max(self.row0, self.key0, abs(self.diagonal or 0)) >= 2**31:
            raise ValueError(f"row0, key0 and the diagonal must fit in 32 bits, got {self.row0}, "
                             f"{self.key0} and {self.diagonal}")
        if self.diagonal is not None and self.varlen:
            raise ValueError("a varlen call cannot be placed in a larger problem: each sequence is its own")

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def windowed(self) -> bool:
        return self.window != (-1, -1)

    @property
    def active(self) -> bool:
        # A call placed in a larger problem runs the general kernels: the dense ones
        # align the causal diagonal at the call's own corner.
        return self._bounds_keys or self._beyond_bounds

    @property
    def band_only(self) -> bool:
        """Whether every option on only bounds the keys each row sees: a window, key
        padding (seqlens_k), varlen sequences, a place in a larger problem. They hide
        keys and skip tiles and change nothing else (the GPU backward runs them on its
        dense path)."""
        return self._bounds_keys and not self._beyond_bounds

    @property
    def skips_tiles_only(self) -> bool:
        """Whether every option on bounds the keys each row sees (`band_only`) or leaves
        out blocks of scores (a block mask), and changes nothing else: where the mask's
        blocks are whole tiles of its kernels, the GPU backward runs these on its dense
        path too (kernels_cu/mask.cuh BLOCKS)."""
        return (self._bounds_keys or self.block_mask is not None) and not self._changes_scores

    @property
    def dense_path_term(self) -> str | None:
        """The one option on beside a band and a block mask where it is ALiBi, softcap or
        dropout ("alibi", "softcap", "dropout"), else None. The GPU backward runs such
        calls on its dense path too: ALiBi's gradient is dense attention's, softcap's
        derivative is a factor per score in the pass that forms dS, and dropout's draws
        are selects in the passes (kernels_cu/mods.cuh MODE_ALIBI, MODE_SOFTCAP,
        MODE_DROPOUT)."""
        if self.bias is not None:
            return None
        on = [name for name, flag in (("alibi", self.alibi_slopes is not None), ("softcap", self.softcap > 0),
                                      ("dropout", self.dropout_p > 0)) if flag]
        return on[0] if len(on) == 1 else None

    @property
    def _bounds_keys(self) -> bool:
        """An option on that bounds the keys each row sees (mask.cuh's band)."""
        return self.windowed or self.varlen or self.diagonal is not None or self.seqlens_k is not None

    @property
    def _beyond_bounds(self) -> bool:
        """An option on that does more: a block mask, a score term or dropout."""
        return self.block_mask is not None or self._changes_scores

    @property
    def _changes_scores(self) -> bool:
        """A score term or dropout on."""
        return self.softcap > 0 or self.dropout_p > 0 or self.bias is not None or self.alibi_slopes is not None

    def call_diagonal(self, nq: int, nk: int) -> int:
        """``off`` of a batch entry of ``nq`` rows and ``nk`` keys in this call's own
        indices: the diagonal key of row ``i`` is ``i + off``."""
        return nk - nq if self.diagonal is None else self.diagonal + self.row0 - self.key0


NONE = Modifiers()

# The fields of `Modifiers` that hold arrays (None where the option is off), and those of
# them that are small int32 index arrays.
ARRAY_FIELDS = ("block_mask", "bias", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k")
INDEX_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "seqlens_k")
