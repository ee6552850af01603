"""cuDNN's deterministic attention backward, through NVIDIA's cuDNN frontend (``pip install nvidia-cudnn-frontend``).

torch's cuDNN attention backward (``CudnnOps``) accumulates dQ with atomics, so
its bits change run to run and the library's bitwise-identical promise cannot
use it. cuDNN also has a deterministic backward (dQ partials per key tile in a
workspace, reduced in a fixed order); torch does not expose it, the frontend's
graph API does (``sdpa_backward(..., use_deterministic_algorithm=True)``).
``CudnnFrontendOps`` is ``CudnnOps`` with that backward: ``CudnnKernel`` on it is
the ``"cudnn-det"`` implementation (cuDNN forward, deterministic cuDNN backward).
Its forward is the frontend's too, the same cuDNN kernel as torch's op, but it
writes its result where it is told: a pattern that takes several calls (one per
dilation offset group or segment run) fills its compact part with no copy after.

Measured on an H200 with cuDNN 9.19 (per pattern: ``benchmarks/results/kernel_h200.json``):
bitwise equal over repeated runs where torch's backward differed, 3-13% slower
than the atomic one, gradients within bf16 rounding of it. Its workspace is
about ``ceil(keys / 256)`` times the fp32 size of dQ (32 GiB for one 32768-row
segment of 16 heads), so a call is split, batch first (under ``batch_workspace_limit``), then keys (under
``workspace_limit``): splitting a batch costs nothing measurable, splitting keys does. Splitting keys is exact: each key chunk's dK/dV are
complete, and its dQ part (from the final ``out``/``lse``, as every backward
here) is summed in fp32 in a fixed order. Causal key chunk ``[k0, k1)`` pairs
with queries ``[k0, M)``: its mask is then cuDNN's top-left one.
"""

from __future__ import annotations

import gc
import math
from collections import OrderedDict

import torch

from .. import caches
from ..merge import current_raw_stream
from .cudnn import CudnnOps

WORKSPACE_LIMIT = 2 << 30  # bytes per call that must split its keys; measured: 2 GiB costs 10% against an unsplit
# full-attention call
# bytes per call that splits only its batch (LongNet's segments and offset groups): 512 MiB. Measured on 2 x H100
# (fwd+bwd through the API, alternated runs, LongNet 32768 tokens per GPU, flash-attn-4 installed so that auto
# runs cuDNN's deterministic backward on the short causal segments only), against 2 GiB: the causal ring the same
# time (12.21 / 12.24 ms) at 1.71x its own q, k, v, out and gradients instead of 3.01x, non-causal unchanged (1.71x);
# one GPU on 65536 rows causal +2.7%. Without flash-attn-4 (cudnn-det also runs 4096-8192-row segments) 512 MiB
# measured +0.4% / +7.4% (non-causal / causal) on one GPU at 1.83x instead of 3.28x; pass
# ``batch_workspace_limit=2 << 30`` for speed first
BATCH_WORKSPACE_LIMIT = 512 << 20
# cudnn-det's ``causal_block`` (``ring/square_split.py``): full causal attention through the API, forward+backward
# on an H100, alternated runs, split / whole: 65536 rows 0.86x in blocks of 4096 (2048: 0.87x, 8192: 0.87x),
# 32768 rows 0.96x, 16384 rows 1.00x (so it stays whole: four blocks)
CAUSAL_BLOCK = 4096
_KEY_TILE = 256  # the workspace holds one fp32 dQ per this many keys (cuDNN 9.19, measured)
_GRAPHS_KEPT = 256


@caches.memoize("cudnn_frontend.module", 1)  # looked up on every backward call: import once
def _frontend():
    """The ``cudnn`` frontend module, or ``None`` when it is not installed or cannot load."""
    try:
        import cudnn
    except (ImportError, OSError):
        return None
    # another package may own the name ``cudnn``: the frontend is the one with the graph API
    return cudnn if getattr(cudnn, "pygraph", None) is not None else None


def _collect_build_cycles() -> None:
    """Collect the reference cycles a graph's build and first run leave behind. The frontend's Python layer
    (1.32) leaves cycles that hold the frames it ran under, and through them every frame up the stack, ours and
    our callers': their tensors then outlive the call until Python's collector next runs. Measured on an H100
    (LongNet causal at 32768 tokens, the first step): a 2048-row segment's backward workspace of 512 MiB was
    held beside the next calls' (2.0x own bytes instead of the 1.5x of every later step). Once per new graph, and
    not under CUDA-graph capture: what the collector frees may release CUDA memory, which a capture forbids."""
    gc.collect()


def _empty_in_layout(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor of ``x``'s shape whose strides keep ``x``'s dim order (what torch's op allocates)."""
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    dense = torch.empty([x.shape[d] for d in order], dtype=dtype or x.dtype, device=x.device)
    return dense.permute(*[order.index(d) for d in range(x.dim())])


def workspace_estimate(batch: int, heads: int, q_rows: int, k_rows: int, dim: int) -> int:
    """Bytes of cuDNN's deterministic-backward workspace for one call (measured rule, see module doc)."""
    return math.ceil(k_rows / _KEY_TILE) * batch * heads * q_rows * dim * 4


def split_plan(batch: int, heads: int, rows: int, dim: int, limit: int,
               batch_limit: int | None = None) -> tuple[int, int]:
    """``(batch items per call, keys per call)``: where one item's workspace fits ``limit``, as many items as keep
    it under ``batch_limit`` (default ``limit``; at least one item), all keys; else one item and as many key tiles
    as keep it under ``limit`` (at least one)."""
    per_item = workspace_estimate(1, heads, rows, rows, dim)
    if per_item <= limit:
        return max(1, min(batch, min(limit, batch_limit or limit) // per_item)), rows
    tiles = max(1, limit // workspace_estimate(1, heads, rows, _KEY_TILE, dim))
    return 1, min(rows, tiles * _KEY_TILE)


def _pointer_order(graph, nodes) -> list[int] | None:
    """The positions of ``nodes``' tensors in the order the graph's raw-pointer execute takes them (its uids
    sorted), or ``None`` on a frontend without it (then ``graph.execute`` maps tensors by node)."""
    needed = ("_execute_with_ptrs", "_get_variant_pack_uids_sorted")  # (frontend 1.22 has them, 1.16 not)
    if not all(callable(getattr(graph, name, None)) for name in needed):
        return None
    position = {node.get_uid(): i for i, node in enumerate(nodes)}
    order = [position.get(uid) for uid in graph._get_variant_pack_uids_sorted()]
    return order if None not in order and len(order) == len(nodes) else None


class CudnnFrontendOps(CudnnOps):
    """``CudnnOps`` on the frontend's graph API: cuDNN's deterministic backward, and a forward that writes
    into a given view (both write their results where ``CudnnKernel`` asks)."""

    name = "cudnn-det"
    deterministic_backward = True
    own_strides = True  # a graph is built per every tensor's strides (``_graph``): out/dout need not be q's
    # its calls are not stacked (``ring/stacking.py``): on an H200 stacking gained 0.97-1.27x (two runs disagreed)
    # for 770 MiB more peak memory
    stacks_patterns = False

    def __init__(self, workspace_limit: int = WORKSPACE_LIMIT, batch_workspace_limit: int = BATCH_WORKSPACE_LIMIT
                 ) -> None:
        """``workspace_limit``: bytes of workspace per call that splits its keys; ``batch_workspace_limit``: per
        call that splits only its batch (``split_plan``)."""
        for name, value in (("workspace_limit", workspace_limit), ("batch_workspace_limit", batch_workspace_limit)):
            if value <= 0:
                raise ValueError(f"{name} must be a positive byte count, got {value}")
        self.workspace_limit, self.batch_workspace_limit = workspace_limit, batch_workspace_limit
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._handles: dict[int, object] = {}
        self._streams: dict[int, int] = {}  # the stream each device's handle was last set to

    def supports(self, q: torch.Tensor, k: torch.Tensor) -> str | None:
        reason = super().supports(q, k)
        if reason is None and _frontend() is None:
            reason = "needs NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend"
        return reason

    def backward(self, dout, q, k, v, out, lse4, *, causal: bool, scale: float,
                 into: tuple[torch.Tensor, ...] | None = None):
        """``(dq, dk, dv)``, written into ``into`` (views shaped like q, k, v) when given: no copy after."""
        batch, heads, rows, dim = q.shape
        if k.shape[2] != rows:
            raise ValueError(f"q and k must have equal rows, got {rows} and {k.shape[2]}")
        dq, dk, dv = into if into is not None else (_empty_in_layout(x) for x in (q, k, v))
        per_call, keys = split_plan(batch, heads, rows, dim, self.workspace_limit, self.batch_workspace_limit)
        if per_call >= batch and keys == rows:  # one call: the tensors themselves (nine slices cost a call's host)
            self._run((dout, q, k, v, out, lse4), (dq, dk, dv), causal, scale)
            return dq, dk, dv
        for b0 in range(0, batch, per_call):
            b = slice(b0, b0 + per_call)
            if keys == rows:
                self._run((dout[b], q[b], k[b], v[b], out[b], lse4[b]), (dq[b], dk[b], dv[b]), causal, scale)
                continue
            dq_sum = torch.zeros(dq[b].shape, dtype=torch.float32, device=q.device)
            for k0 in range(0, rows, keys):
                ks, qs = slice(k0, k0 + keys), slice(k0 if causal else 0, rows)
                part = _empty_in_layout(q[b][:, :, qs])
                self._run((dout[b][:, :, qs], q[b][:, :, qs], k[b][:, :, ks], v[b][:, :, ks], out[b][:, :, qs],
                           lse4[b][:, :, qs].contiguous()), (part, dk[b][:, :, ks], dv[b][:, :, ks]), causal, scale)
                dq_sum[:, :, qs] += part
            dq[b].copy_(dq_sum)
        return dq, dk, dv

    def forward(self, q, k, v, *, causal: bool, scale: float, out: torch.Tensor | None = None):
        """``(out, lse)`` from the frontend's forward graph, written into ``out`` (a view shaped like q) when
        given: a pattern's calls fill its compact part with no copy after (torch's op allocates its own)."""
        batch, heads, rows, _ = q.shape
        res = out if out is not None else _empty_in_layout(q)
        lse4 = torch.empty((batch, heads, rows, 1), dtype=torch.float32, device=q.device)
        self._execute((q, k, v, res, lse4), "forward", causal, scale)
        return res, lse4

    def _run(self, inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             causal: bool, scale: float) -> None:
        """One backward graph call: ``inputs`` ``(dout, q, k, v, out, lse4)`` (``backward``'s order), ``grads``
        ``(dq, dk, dv)`` the views it writes."""
        dout, q, k, v, out, lse4 = inputs
        self._execute((q, k, v, out, dout, lse4, *grads), "backward", causal, scale)

    def _execute(self, tensors, direction: str, causal: bool, scale: float) -> None:
        """Run the ``direction`` graph on ``tensors`` (its inputs, then its outputs), built once per geometry.
        A LongNet forward is host-bound (ten of these calls and a combine issue slower than the GPU runs them):
        raw data pointers in the graph's own order, no Python stream object, no detached copies."""
        cudnn = _frontend()
        q = tensors[0]
        index = q.device.index
        (graph, nodes, workspace_bytes, order), built = self._graph(cudnn, tensors, direction, causal, scale)
        handle = self._handles[index]
        stream = current_raw_stream(index)
        if self._streams.get(index) != stream:  # (set once per stream: it costs a call per launch)
            cudnn.set_stream(handle=handle, stream=stream)
            self._streams[index] = stream
        # no workspace (most forwards): no allocation, a null pointer
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device) if workspace_bytes else None
        if order is not None:
            graph._execute_with_ptrs([tensors[i].data_ptr() for i in order],
                                     0 if workspace is None else workspace.data_ptr(), handle)
        else:  # (as a graph's build, older frontends' execute may read tensors through DLPack)
            graph.execute(dict(zip(nodes, (x.detach() for x in tensors))),
                          0 if workspace is None else workspace, handle=handle)
        if built and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            _collect_build_cycles()

    def _graph(self, cudnn, tensors, direction: str, causal: bool, scale: float) -> tuple[tuple, bool]:
        """``((graph, nodes, workspace bytes, pointer order), whether this call built it)``."""
        q = tensors[0]
        key = (q.device.index, direction, causal, scale, *((x.dtype, x.shape, x.stride()) for x in tensors))
        hit = self._graphs.get(key)
        if hit is not None:
            self._graphs.move_to_end(key)
            return hit, False
        if q.device.index not in self._handles:
            with torch.cuda.device(q.device):
                self._handles[q.device.index] = cudnn.create_handle()
        io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[q.dtype]
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=self._handles[q.device.index])
        if direction == "forward":  # (q, k, v) -> (out, stats: the natural-log lse, (B, h, M, 1) fp32)
            inputs = [graph.tensor_like(x.detach()) for x in tensors[:3]]  # (DLPack refuses grad-requiring ones)
            results = graph.sdpa(q=inputs[0], k=inputs[1], v=inputs[2], generate_stats=True, attn_scale=scale,
                                 use_causal_mask=causal)
            types = (io, cudnn.data_type.FLOAT)
        else:  # (q, k, v, out, dout, lse) -> (dq, dk, dv)
            inputs = [graph.tensor_like(x.detach()) for x in tensors[:6]]
            results = graph.sdpa_backward(q=inputs[0], k=inputs[1], v=inputs[2], o=inputs[3], dO=inputs[4],
                                          stats=inputs[5], attn_scale=scale, use_causal_mask=causal,
                                          use_deterministic_algorithm=True)
            types = (io,) * 3
        for node, x, dtype in zip(results, tensors[len(inputs):], types):
            node.set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride())).set_data_type(dtype)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        except Exception as exc:  # the frontend raises its own types: a refusal is a RuntimeError here
            raise RuntimeError(f"cuDNN frontend refused the {direction} for q {tuple(q.shape)} "
                               f"strides {q.stride()}: {exc}") from exc
        nodes = [*inputs, *results]
        entry = (graph, nodes, graph.get_workspace_size(), _pointer_order(graph, nodes))
        self._graphs[key] = entry
        if len(self._graphs) > _GRAPHS_KEPT:
            self._graphs.popitem(last=False)
        return entry, True
