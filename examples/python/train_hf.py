#!/usr/bin/env python3
"""A Hugging Face transformers model trained with Varuna in the manual's
form: the model unchanged, varuna.hf.cut_between_blocks(model) for the
CutPoints, its tied embeddings as transformers ties them. GPT-2, a
Llama-style decoder or a BERT-style encoder (masked LM), built from a config
(nothing downloaded), trained on the licence texts every Debian system has,
one character a token.

    .venv/bin/python scripts/varuna_launch.py --nstages 2 --replicas 2 --chunk_size 4 --batch_size 16 \\
        -- .venv/bin/python examples/python/train_hf.py --model llama --steps 100

Under run_varuna it is a worker program like any other (checkpoints in the
job's store, morphs). --meta builds the model on the meta device: each rank
materialises only its pieces, initialised by the model's own _init_weights.
"""
import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (CharDataset: the example's data)
import varuna  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["gpt2", "llama", "bert"], default="gpt2")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default="/usr/share/common-licenses")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", help="cpu, or cuda (this worker's GPU by its local rank)")
    p.add_argument("--meta", action="store_true", help="build on the meta device")
    p.add_argument("--checkpoint_dir", default="", help="global store (default: run_varuna's)")
    return p.parse_args(argv)


def build(o, vocab):
    common = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if o.model == "gpt2":
        config = transformers.GPT2Config(n_positions=o.seq_len, n_embd=o.width, n_layer=o.layers, n_head=o.heads,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        cls = transformers.GPT2LMHeadModel
    elif o.model == "llama":
        config = transformers.LlamaConfig(hidden_size=o.width, intermediate_size=2 * o.width, num_hidden_layers=o.layers,
                                          num_attention_heads=o.heads, num_key_value_heads=max(1, o.heads // 2),
                                          max_position_embeddings=o.seq_len, tie_word_embeddings=True, **common)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.BertConfig(hidden_size=o.width, intermediate_size=2 * o.width, num_hidden_layers=o.layers,
                                         num_attention_heads=o.heads, max_position_embeddings=o.seq_len,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         vocab_size=vocab + 1, pad_token_id=0)  # the last token id is [MASK]
        cls = transformers.BertForMaskedLM
    torch.manual_seed(1)
    if o.meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def batch_of(o, data, step, size):
    """The step's global batch: causal LMs predict each next character;
    BERT the 15% of characters masked (the same count in every sample)."""
    samples = data.samples(step * size, size, o.seq_len, 7)
    ids = samples["tokens"]
    if o.model != "bert":
        return {"input_ids": ids, "labels": ids.clone()}
    gen = torch.Generator().manual_seed(step)
    masked = torch.stack([torch.randperm(o.seq_len, generator=gen)[:max(1, o.seq_len * 15 // 100)]
                          for _ in range(size)])
    rows = torch.arange(size)[:, None]
    labels = torch.full_like(ids, -100)
    labels[rows, masked] = ids[rows, masked]
    inputs = ids.clone()
    inputs[rows, masked] = data.vocab_size  # [MASK]
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


def main():
    varuna.install_checkpoint_signal_handler()
    launch = varuna.get_launch_args()
    o = parse(launch.user_args)
    data = gpt.CharDataset.from_path(o.data)
    model = varuna.hf.cut_between_blocks(build(o, data.vocab_size))
    store = o.checkpoint_dir or launch.global_store
    global_batch = launch.batch_size if launch.batch_size > 0 else 8 * launch.replicas

    def get_batch(size, device):
        return {k: v.to(device) for k, v in batch_of(o, data, 0, size).items()}

    runtime = varuna.Varuna(model, get_batch_fn=get_batch, batch_size=global_batch, launch_args=launch,
                            precision=o.precision, device=o.device, global_store=store or None, seed=1,
                            init_fn=varuna.hf.init_fn(model) if o.meta else None)
    del model  # this rank keeps only its pieces
    runtime.set_optimizer(torch.optim.AdamW(runtime.parameters(), lr=o.lr, weight_decay=0.01))
    if launch.resume_step >= 0 and store:
        runtime.load_latest_checkpoint(store, at_most=launch.resume_step)
    share = global_batch // runtime.num_replicas
    for step in range(runtime.steps_done, o.steps):
        batch = batch_of(o, data, step, global_batch)
        result = runtime.step({k: v[runtime.replica * share:(runtime.replica + 1) * share] for k, v in batch.items()},
                              clip_grad_max_norm=1.0)
        if launch.rank == 0 and (step % 10 == 0 or step + 1 == o.steps):
            print("step %d loss %.4f grad_norm %.3f" % (step, result.loss, result.grad_norm), flush=True)
        runtime.exit_if_checkpoint_requested(result)
    held_out = batch_of(o, data, o.steps, global_batch)
    loss = runtime.evaluate({k: v[runtime.replica * share:(runtime.replica + 1) * share] for k, v in held_out.items()})
    if launch.rank == 0:
        print("eval loss %.4f" % loss, flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as error:  # noqa: BLE001 - every failure ends the worker with its code
        varuna.exit_after_failure(error)
