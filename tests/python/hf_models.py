"""Small Hugging Face transformers models built from configs (never
downloaded), their data, and their plain one-process training, for
hf_test.py: GPT-2, a Llama-style decoder (RoPE, RMSNorm, SwiGLU, grouped-query
attention) and a BERT-style encoder with a masked-LM head, each with its
embeddings tied as transformers ties them and dropout off.

Every sample has the same number of tokens that count in the loss (causal
LMs: all but the last; BERT: exactly MASKED per sample), so the mean over a
micro-batch's tokens, weighted by its samples, is the mean over the batch's
tokens: the loss the plain model computes on the whole batch."""
import torch
import transformers

VOCAB, SEQ, WIDTH, BLOCKS, MASKED = 61, 8, 32, 4, 2
KINDS = ("gpt2", "llama", "bert")


def config(kind):
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=BLOCKS, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0)
    if kind == "llama":
        return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                        num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ, tie_word_embeddings=True, bos_token_id=0,
                                        eos_token_id=0, pad_token_id=0)
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                   num_hidden_layers=BLOCKS, num_attention_heads=4, max_position_embeddings=SEQ,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}


def build(kind, meta=False):
    """The model, its weights from torch.manual_seed(7) (unless on meta)."""
    torch.manual_seed(7)
    cls = getattr(transformers, _CLASSES[kind])
    if meta:
        with torch.device("meta"):
            return cls(config(kind))
    return cls(config(kind))


def global_batch(kind, step, size):
    gen = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(1, VOCAB, (size, SEQ), generator=gen)
    if kind != "bert":
        return {"input_ids": ids, "labels": ids.clone()}
    labels = torch.full_like(ids, -100)
    masked = torch.stack([torch.randperm(SEQ, generator=gen)[:MASKED] for _ in range(size)])
    rows = torch.arange(size)[:, None]
    labels[rows, masked] = ids[rows, masked]
    inputs = ids.clone()
    inputs[rows, masked] = VOCAB - 1  # the [MASK] token
    return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def unique_parameters(model):
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def plain_run(model, kind, steps, batch, optimizer, micro=None, reverse=False):
    """Trains `model` plainly; (losses, gradient norms in float64, every
    parameter by every name). micro: gradients accumulated over
    micro-batches of this size (reverse: last first) instead of one
    backward over the batch: the same gradient, summed in another order."""
    opt = make_optimizer(optimizer, unique_parameters(model))
    losses, norms = [], []
    for step in range(steps):
        full = global_batch(kind, step, batch)
        opt.zero_grad()
        if micro is None:
            loss = model(**full).loss
            loss.backward()
            losses.append(loss.item())
        else:
            starts = list(range(0, batch, micro))
            total = 0.0
            for start in (reversed(starts) if reverse else starts):
                part = {k: v[start:start + micro] for k, v in full.items()}
                loss = model(**part).loss * (micro / batch)
                loss.backward()
                total += loss.item()
            losses.append(total)
        norms.append(sum(p.grad.double().square().sum().item() for p in unique_parameters(model)) ** 0.5)
        opt.step()
    # Every name of a tensor held under two names maps to the same copy.
    copies = {}
    return losses, norms, {n: copies.setdefault(id(p), p.detach().clone())
                           for n, p in model.named_parameters(remove_duplicate=False)}
