"""The workloads of issue 9, one module each, by id.

A workload module has ``ID``, ``TITLE``, ``STEPS`` (warm-up and timed steps of a full
run), ``make_data()`` (NumPy batches and initial weights, shared by every side) and
``build(data, sides=None)`` returning a ``runner.Built``; optionally
``extras(stats)`` for figures of its own (W5's GEMM bound, G2's optimizer state). G1
(issue 18) needs transformers, G2 (issue 41) peft too; L1 and L2 (issue 48) need
transformers and define ``make_quick_data`` (a two-layer model for the quick run), as
do M1 (issue 50) and G3 (issue 49, LoRA on L1's model, peft too); M2 (issue 50) times
the head's loss alone, with ``make_quick_data`` a tiny head.
"""

from . import (
    d1_data_parallel,
    d2_sharded,
    g1_gpt2,
    g2_lora,
    g3_llama_lora,
    l1_llama,
    l2_llama_generate,
    m1_qwen_memory,
    m2_head_loss,
    w1_tied_lm,
    w2_small_mlp,
    w3_shared_reuse,
    w4_optimizer,
    w5_matmul,
)

WORKLOADS = {
    m.ID: m
    for m in (
        w1_tied_lm,
        w2_small_mlp,
        w3_shared_reuse,
        w4_optimizer,
        w5_matmul,
        g1_gpt2,
        g2_lora,
        l1_llama,
        l2_llama_generate,
        g3_llama_lora,
        m1_qwen_memory,
        m2_head_loss,
        d1_data_parallel,
        d2_sharded,
    )
}

__all__ = ["WORKLOADS"]
