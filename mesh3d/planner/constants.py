"""Every constant of the planner's model, in one place, with where its value comes from.

The planner counts what it can (FLOPs, bytes, the schedule's order); these are the few figures it
cannot count, what real runs reach of the hardware's peaks. docs/plan.md shows the predictions
they give against published runs.
"""

# Fraction of the dense peak a transformer's matmuls and attention reach in a real step (kernel
# efficiency, memory-bound ops between them, launch gaps), counted in the FLOPs the step executes
# (recomputation included), for hardware fitted on no published run: the presets carry their own,
# fitted per GPU (hardware.py; the H100 0.37 at 500 W and 0.445 at 700 W, the A100 0.641). 0.45:
# Megatron-LM's weak-scaling runs on A100 (Narayanan et al. 2021, Table 1) reach 43-52 % of peak in
# exactly that count.
ACHIEVABLE_COMPUTE_FRACTION = 0.45

# The error band stated for hardware fitted on no published run (a `Hardware` of the user's, the
# b200 preset): with the one fraction above for every GPU, the planner stood from -41 % to +25 %
# of the published runs of docs/plan.md when per-GPU fitting came (hardware.py), from -35 % to
# +29 % as they are modelled now.
UNCALIBRATED_ERROR_BAND = 0.40

# How near the memory limit a plan's predicted memory may come before the planner treats it as
# possibly not fitting (band.py ranks such plans after the roomy ones as fast as them): the
# planner's predictions stand 4.7 % and 5.5 % under the published peaks of docs/plan.md; about twice that.
MEMORY_PREDICTION_BAND = 0.10

# The error band of "this-machine", whose parts are timed rather than rated: against real
# 2-rank steps every layout came within 25 % (docs/performance.md).
MEASURED_MACHINE_ERROR_BAND = 0.25

# torch.compile's gain on the same compute (fusing the elementwise ops between the matmuls):
# torchtitan reports 6-10 % more tokens/s with compile on Llama 3 8B/70B.
COMPILE_SPEEDUP = 1.08

# Fraction of the HBM bandwidth a streaming elementwise kernel reaches (a softmax or a dropout over
# an attention score matrix written out: copy and triad kernels reach 80-90 % of the datasheet rate
# on A100 and H100). Fused attention kernels write no score matrix, so this charges only the ones
# that do (measure/meters.py's ScoreMatrixBytes); the fitted compute fractions absorb the rest.
ACHIEVABLE_MEMORY_FRACTION = 0.8

# Fraction of the link's bandwidth a collective reaches (NCCL ring all-gather / reduce-scatter on
# NVLink and on 400 Gb/s InfiniBand reach 70-85 % of the line rate in nccl-tests' bus bandwidth).
ACHIEVABLE_LINK_FRACTION = 0.75

# Tensor-parallel collectives sit between the matmuls that need their results: mesh3d issues
# them synchronously (no async TP), so none of their time is hidden.
TP_HIDDEN_FRACTION = 0.0

# Context parallelism's K/V all-gather comes right before the attention that reads it, and the
# dK/dV reduce-scatter right after the backward that makes them (context_parallel/attention.py:
# one all-gather per layer, no ring of partial attentions to overlap it with): none is hidden.
CP_HIDDEN_FRACTION = 0.0

# Unpinned, context parallelism is searched from this sequence length on: Llama 3 trained its
# 8k-token stage without it and turned to cp 16 only to extend to 128k; torchtitan's cp runs start
# at 32k. Below it a sequence's activations fit beside the parameters, and every cp degree would
# multiply the candidates the planner times for layouts that lose to dp. fix={"cp": N} plans any N.
CP_SEARCHED_FROM_SEQ_LEN = 16384

# FSDP/DDP traffic overlaps compute (FSDP2 prefetches the next block's all-gather; DDP buckets
# reduce during the backward); what exceeds the step's compute is exposed, plus this much of it
# that nothing can hide (the first all-gather, the last reduce-scatter).
DP_UNHIDDEN_FRACTION = 0.05

# A selective recompute reruns only the cheap ops (norms, activations, rotary): memory-bound, about
# this fraction of the stage's forward time (the selective-AC measurements in Korthikanti et al.
# 2022, "Reducing Activation Recomputation in Large Transformer Models": 2-4 % overhead).
SELECTIVE_RECOMPUTE_FRACTION = 0.05

# AdamW's update touches, per parameter, the fp32 weight, gradient and two moments (read) and
# the weight and moments (written): 28 bytes, memory-bound.
ADAMW_BYTES_PER_PARAMETER = 28

# Memory the planner keeps free on a device by default: the CUDA context and NCCL's buffers
# (about 1-2 GiB) and the caching allocator's fragmentation (PyTorch's memory docs).
MEMORY_MARGIN_FRACTION = 0.10

# Split backward: the weight-gradient half of a block's backward is about half its time (the
# input-gradient and weight-gradient matmuls have the same FLOPs).
WEIGHT_GRAD_SHARE_OF_BACKWARD = 0.5

# A machine the planner measures ("this-machine", measure/machine_bench.py) has its model's parts timed
# (measure/part_timing.py): each part runs once to warm up (allocations, DTensor's sharding caches),
# then this many times, and the best counts (a quiet machine's time; a shared one only adds).
TIMING_REPEATS = 10

# Before each timed forward and backward the timer writes this many bytes, so the part's weights
# and inputs come from memory as in a step, where other parts run in between: more than the
# last-level cache of this machine (32 MiB L3, lscpu) and of a server CPU's core complex.
CACHE_FLUSH_BYTES = 64 * 2**20
