# Environment for torchrun jobs of dilated_attention, single- or multi-node.
# Sourced by launch/multinode.sh (ENV_FILE=... picks another file); `source` it yourself
# before a plain torchrun. Every variable is set only if it is still unset, so what your
# cluster (or you) exported wins. Values that depend on your fabric are left commented.
#
# Threads --------------------------------------------------------------------------------
# torchrun sets OMP_NUM_THREADS=1 when it starts several processes per node. Ranks here
# spend their CPU time launching kernels and in NCCL's proxy threads, so a few threads each
# is plenty; on CPU-only (gloo) runs give each rank its share of the cores instead.
: "${OMP_NUM_THREADS:=4}"
export OMP_NUM_THREADS
#
# NCCL -----------------------------------------------------------------------------------
# Warnings only; NCCL_DEBUG=INFO (plus NCCL_DEBUG_SUBSYS=INIT,NET) shows which transport
# each ring step takes (P2P/NVLink inside a node, NET/IB across nodes): the first thing to
# read when a multi-node ring is slower than the cost model says.
: "${NCCL_DEBUG:=WARN}"
export NCCL_DEBUG
# A failed or timed-out collective aborts the communicator and raises, instead of hanging
# (torch >= 2.2 name; the library's own DILATED_ATTENTION_TIMEOUT below covers its waits).
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING
# Dump NCCL's flight recorder (which collective each rank was in) when a timeout fires.
: "${TORCH_NCCL_TRACE_BUFFER_SIZE:=2000}"
: "${TORCH_NCCL_DUMP_ON_TIMEOUT:=1}"
export TORCH_NCCL_TRACE_BUFFER_SIZE TORCH_NCCL_DUMP_ON_TIMEOUT
# Bootstrap interface: the one the nodes reach each other on (not lo, not docker0).
# export NCCL_SOCKET_IFNAME=ib0            # or eth0, or ^lo,docker0 to exclude
# InfiniBand: which HCAs NCCL may use (one NDR port per GPU on H100/H200 nodes), GPUDirect RDMA.
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
# export NCCL_NET_GDR_LEVEL=PHB             # GPU<->NIC RDMA when they share a PCIe host bridge
# RoCE instead of InfiniBand: the GID index of RoCE v2 (often 3) and the traffic class your network uses.
# export NCCL_IB_GID_INDEX=3
# export NCCL_IB_TC=106
# AWS EFA: export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 (and the aws-ofi-nccl plugin).
# NVLink SHARP / multicast (NCCL_NVLS_ENABLE): leave it as your site sets it. Shared machines
# may require it off (NCCL_NVLS_ENABLE=0); the ring and all-to-all here do not use it.
#
# CUDA -----------------------------------------------------------------------------------
# Do NOT set CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's tensor-parallel setting): it
# serialises NCCL's streams behind compute and the ring's overlap disappears.
# Fewer cudaMalloc stalls when sequence lengths change between calls (the max-length probe):
: "${PYTORCH_CUDA_ALLOC_CONF:=expandable_segments:True}"
export PYTORCH_CUDA_ALLOC_CONF
#
# dilated_attention and DeepSpeed ---------------------------------------------------------
# Seconds any rank waits for a peer before raising an error that names it (docs/design.md section 3).
: "${DILATED_ATTENTION_TIMEOUT:=600}"
export DILATED_ATTENTION_TIMEOUT
# DeepSpeed chooses its accelerator on import; skip its detection (cpu for gloo-only runs).
if [ -z "${DS_ACCELERATOR:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DS_ACCELERATOR=cuda
  else
    DS_ACCELERATOR=cpu
  fi
fi
export DS_ACCELERATOR
# Debugging only (slow): export TORCH_DISTRIBUTED_DEBUG=DETAIL
