"""zp.test.gpt.hf: gpt::write_hf's directory read as Hugging Face's GPT-2 reads it.

Runs tests/gpt_hf_export.cpp (its path is argv[1]; argv[2] a work directory), then loads
<work>/hf/config.json and model.safetensors with the `safetensors` package and computes GPT-2's
forward in float64 with numpy the way transformers' GPT2LMHeadModel does (names and shapes as
in its state dict: Conv1D weights [in, out] applied as x W + b, q | k | v side by side in
c_attn, heads split in order, causal softmax at 1/sqrt(d/H), gelu_new, LayerNorm at
layer_norm_epsilon, lm_head an nn.Linear [V, d] applied as x W^T). Its logits must equal the
C++ model's to fp32 rounding, and so must those of transformers' GPT2LMHeadModel.from_pretrained
on the directory. A GPT-2 that transformers initialises and saves, read into zp (gpt::read_hf,
zp_gpt --init-from's reader), gives transformers' loss and logits on the same tokens.

With argv[3], the path of zp_gpt: trains it on a repeating text and exports it (--export), and the
numpy GPT-2 on that directory, reading vocab.json, must continue the pattern greedily as zp_gpt's
own --sample does: the whole export path (gathered parameters, names, vocabulary) end to end.
zp_gpt --init-from a transformers-saved GPT-2 on a 2 x 2 x 2 grid then reports, with --eval, the
loss transformers computes on the same text. Trained on llm.c's token files (--tokens), zp_gpt
exports the same model as from the text of the same ids, and transformers on its export of a
run with ids above 255 computes its --eval loss.
"""
import json
import os
import subprocess
import sys

import numpy as np

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep the test's log to its findings
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

if not __debug__:
    sys.exit("gpt_hf_check.py: its checks are asserts; run it without -O / PYTHONOPTIMIZE")


def fresh_seed(what):
    """A new seed, or ZP_TEST_SEED's to repeat a failing run; printed."""
    seed = int(os.environ.get("ZP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"{what}: seed {seed} (ZP_TEST_SEED={seed} repeats it)")
    return seed


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def gpt2_logits(weights, cfg, tokens):
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    n_embd, heads, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    hd = n_embd // heads
    batch, t = tokens.shape
    x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][:t]
    mask = np.triu(np.ones((t, t), dtype=bool), k=1)
    for layer in range(cfg["n_layer"]):
        p = f"transformer.h.{layer}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (a.reshape(batch, t, heads, hd).transpose(0, 2, 1, 3)
                   for a in np.split(qkv, 3, axis=-1))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        scores = np.where(mask, -np.inf, scores)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        att = scores / scores.sum(-1, keepdims=True)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(batch, t, n_embd)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        m = gelu_new(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
    return x @ w["lm_head.weight"].T


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def save_transformers_gpt2(directory, seed, max_shard_size="5GB", **shape):
    """A GPT-2 of `shape` (GPT2Config's keys) as transformers' save_pretrained writes it (tied
    head; in files of at most max_shard_size, with an index past it), every parameter drawn from
    N(0, 0.3) so that no loss is near log(vocab) by chance."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(bos_token_id=None, eos_token_id=None, **shape))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return GPT2LMHeadModel.from_pretrained(directory).eval()


def zp_eval_loss(stdout):
    """The loss zp_gpt --eval printed."""
    return float(next(ln for ln in stdout.splitlines() if ln.startswith("eval: loss ")).split()[2])


def transformers_eval_loss(model, ids, context):
    """zp_gpt --eval's loss computed by transformers: every next token of ids predicted once, in
    windows of context + 1 tokens, each starting where the last one's targets end."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):
            window = torch.tensor(ids[start:start + context + 1])
            logits = model(window[None, :-1]).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
    return total / (len(ids) - 1)


def check_trained(gpt, work):
    rng = np.random.default_rng(fresh_seed("the evaluation text"))
    text = os.path.join(work, "pattern.txt")
    with open(text, "w") as f:
        f.write("abcdefgh" * 400)
    eval_path = os.path.join(work, "eval.txt")
    eval_text = b"efghabcdefghabcd" + bytes(rng.choice(list(b"abcdefgh\n"), size=45).tolist())
    with open(eval_path, "wb") as f:
        f.write(eval_text)
    out = os.path.join(work, "trained")
    r = subprocess.run([gpt, "--text", text, "--layers", "1", "--d-model", "32", "--heads", "4",
                        "--context", "16", "--micro-batch", "8", "--lr", "1e-2", "--steps", "150",
                        "--log-every", "150", "--ranks", "2", "--export", out, "--eval",
                        eval_path], check=True, capture_output=True, text=True)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(out, "vocab.json")) as f:
        byte_of_id = json.load(f)["byte_of_id"]
    id_of_byte = {b: i for i, b in enumerate(byte_of_id)}
    # transformers on zp_gpt's own export: the loss zp_gpt reported for the trained model.
    model = GPT2LMHeadModel.from_pretrained(out).eval()
    loss_zp = zp_eval_loss(r.stdout)
    loss_hf = transformers_eval_loss(model, [id_of_byte[b] for b in eval_text], 16)
    print(f"GPT2LMHeadModel.from_pretrained(zp_gpt's export of a bf16 run): eval loss "
          f"{loss_hf:.7f}, zp_gpt's own {loss_zp:.7f}")
    assert abs(loss_zp - loss_hf) <= 1e-5 * abs(loss_hf), (loss_zp, loss_hf)
    weights = load_file(os.path.join(out, "model.safetensors"))
    ids = [id_of_byte[b] for b in b"cde"]
    for _ in range(24):
        window = np.array([ids[-cfg["n_positions"]:]])
        ids.append(int(gpt2_logits(weights, cfg, window)[0, -1].argmax()))
    got = bytes(byte_of_id[i] for i in ids).decode()
    print(f"numpy GPT-2 on zp_gpt's export continues 'cde' as '{got}'")
    assert got == "cdefghabcdefghabcdefghabcde", got

    # --init-from: zp_gpt's own export comes back bit for bit (export -> init-from -> export).
    shape = [gpt, "--text", text, "--layers", "1", "--d-model", "32", "--heads", "4", "--context",
             "16"]
    args = shape + ["--ranks", "2", "--steps", "0"]
    again = os.path.join(work, "again")
    subprocess.run(args + ["--init-from", out, "--export", again], check=True,
                   stdout=subprocess.DEVNULL)
    for name in ("model.safetensors", "config.json", "vocab.json"):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), f"{name} changed through --init-from"
    print("export -> --init-from -> export: the same bytes")

    # A directory as transformers' save_pretrained writes a tied GPT-2 with more positions:
    # no lm_head.weight (it is wte), n_positions 32, a non-persistent buffer saved anyway.
    tied = os.path.join(work, "tied")
    os.makedirs(tied)
    w = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    w["transformer.wpe.weight"] = np.concatenate(
        [w["transformer.wpe.weight"], rng.standard_normal((16, 32)).astype(np.float32)])
    w["transformer.h.0.attn.bias"] = np.ones((1, 1, 32, 32), dtype=np.float32)
    save_file(w, os.path.join(tied, "model.safetensors"), metadata={"format": "pt"})
    cfg_tied = dict(cfg, n_positions=32, tie_word_embeddings=True)
    with open(os.path.join(tied, "config.json"), "w") as f:
        json.dump(cfg_tied, f)
    back = os.path.join(work, "back")
    subprocess.run(args + ["--init-from", tied, "--export", back], check=True,
                   stdout=subprocess.DEVNULL)
    b = load_file(os.path.join(back, "model.safetensors"))
    assert np.array_equal(b["lm_head.weight"], w["transformer.wte.weight"]), "tied head"
    assert np.array_equal(b["transformer.wpe.weight"], w["transformer.wpe.weight"][:16]), "wpe"
    for k in b:
        if k not in ("lm_head.weight", "transformer.wpe.weight"):
            assert np.array_equal(b[k], w[k]), k
    print("a tied directory with 32 positions: lm_head = wte, the first 16 rows of wpe")

    # What cannot be loaded is an error naming it.
    def refused(directory, needle):
        r = subprocess.run(args + ["--init-from", directory], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0 and needle in r.stderr, (needle, r.stderr)
    bad = os.path.join(work, "bad")
    os.makedirs(bad)
    save_file({k: v for k, v in w.items() if k != "transformer.h.0.mlp.c_fc.bias"},
              os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg_tied, f)
    refused(bad, "no tensor named 'transformer.h.0.mlp.c_fc.bias'")
    w2 = dict(w, **{"transformer.h.0.attn.c_attn.weight": w["transformer.h.0.attn.c_attn.weight"].T.copy()})
    save_file(w2, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    refused(bad, "tensor 'transformer.h.0.attn.c_attn.weight' has shape [96,32], not [32,96]")
    save_file(dict(w, **{"transformer.h.2.ln_1.weight": w["transformer.h.0.ln_1.weight"]}),
              os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    refused(bad, "tensor 'transformer.h.2.ln_1.weight' is not one of GPT-2's with n_layer 1")
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(dict(cfg_tied, model_type="llama"), f)
    refused(bad, "model_type is 'llama', not gpt2")
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(dict(cfg_tied, vocab_size=99), f)
    refused(bad, "vocab_size 99 is not this model's vocabulary")
    # Keys that change the arithmetic (transformers would compute another model).
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(dict(cfg_tied, layer_norm_epsilon=1e-3), f)
    refused(bad, "layer_norm_epsilon 0.001 is not 1e-05, this model's")
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(dict(cfg_tied, scale_attn_by_inverse_layer_idx=True), f)
    refused(bad, "scale_attn_by_inverse_layer_idx is true; this model has GPT-2's false")
    # A key of another JSON type, a number past int64 and another architecture are named.
    for change, needle in ((dict(layer_norm_epsilon="1e-5"),
                            'layer_norm_epsilon is "1e-5", not a number'),
                           (dict(tie_word_embeddings="yes"),
                            'tie_word_embeddings is "yes", not a boolean'),
                           (dict(vocab_size=2**63),
                            "no integer 'vocab_size' (9223372036854775808)"),
                           (dict(architectures=["LlamaForCausalLM"]),
                            'architectures is ["LlamaForCausalLM"], not ["GPT2LMHeadModel"]')):
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(dict(cfg_tied, **change), f)
        refused(bad, needle)
    # A FIFO is refused, not waited on.
    os.remove(os.path.join(bad, "config.json"))
    os.mkfifo(os.path.join(bad, "config.json"))
    refused(bad, "not a regular file")
    print("a missing tensor, a transposed one, an extra one, another architecture, another "
          "vocabulary, another layer norm epsilon or attention scaling, a key of another type, "
          "a FIFO config: refused")

    # A GPT-2 that transformers saved, fine-tuned from on a 2 x 2 x 2 grid: zp_gpt's loss of the
    # loaded weights (--steps 0 --eval) on a random text equals transformers' on the same windows
    # (each of context + 1 characters starting where the last one's targets end; the last one
    # short, and 3 windows a forward, so one forward is padded).
    seed = fresh_seed("transformers' GPT-2 for --init-from")
    saved = os.path.join(work, "transformers_saved")
    model = save_transformers_gpt2(saved, seed, max_shard_size="20KB", vocab_size=len(byte_of_id),
                                   n_positions=64, n_embd=32, n_layer=1, n_head=4)
    shards = [f for f in os.listdir(saved) if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(saved), shards
    eval_text = bytes(rng.choice(byte_of_id, size=61).tolist())
    with open(eval_path, "wb") as f:
        f.write(eval_text)
    r = subprocess.run(shape + ["--ranks", "8", "--tp", "2", "--pp", "2", "--micro-batch", "3",
                                    "--precision", "fp32", "--steps", "0", "--init-from", saved,
                                    "--eval", eval_path],
                       check=True, capture_output=True, text=True)
    loss_zp = zp_eval_loss(r.stdout)
    ids = [id_of_byte[b] for b in eval_text]
    loss_hf = transformers_eval_loss(model, ids, 16)
    print(f"zp_gpt --init-from a transformers GPT-2 in {len(shards)} files and an index, on a "
          f"2x2x2 grid, --eval: loss {loss_zp:.7f} (zp), {loss_hf:.7f} (transformers) on "
          f"{len(ids) - 1} predictions; seed {seed}")
    assert abs(loss_zp - loss_hf) <= 1e-5 * abs(loss_hf), (loss_zp, loss_hf)
    for content, needle in ((b"abcz", f"--eval {eval_path}: the character 'z' (byte 122) is not "
                                      "in the training text's vocabulary"),
                            (b"a", f"--eval {eval_path} is too short: 1 character(s), at least 2"),
                            (None, f"cannot read --eval text '{eval_path}': No such file")):
        if content is None:
            os.remove(eval_path)
        else:
            with open(eval_path, "wb") as f:
                f.write(content)
        r = subprocess.run(args + ["--eval", eval_path], capture_output=True, text=True)
        assert r.returncode == 1 and needle in r.stderr, (needle, r.returncode, r.stderr)
    print("--eval of a text with a character the vocabulary lacks, of 1 character, of no file: "
          "refused")


def write_tokens(path, ids):
    """llm.c's token file: 256 little-endian int32 (20240520, version 1, the count), uint16s."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, len(ids)
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(ids, dtype="<u2").tobytes())


def check_tokens(gpt, work):
    """zp_gpt --tokens: training on llm.c's token files."""
    rng = np.random.default_rng(fresh_seed("the token files"))
    shape = [gpt, "--layers", "1", "--d-model", "32", "--heads", "4", "--context", "16",
             "--micro-batch", "4", "--ranks", "2", "--lr", "1e-2"]

    # A text and a token file of the ids zp_gpt gives its characters (in order of first
    # appearance, a newline after the file): the same training, so the same exported bytes.
    text = bytes(rng.choice(list(b"abcdefgh \n"), size=500).tolist())
    text_path, tokens_path = os.path.join(work, "t.txt"), os.path.join(work, "t.bin")
    with open(text_path, "wb") as f:
        f.write(text)
    id_of_byte = {}
    ids = [id_of_byte.setdefault(b, len(id_of_byte)) for b in text + b"\n"]
    write_tokens(tokens_path, ids)
    as_text, as_tokens = os.path.join(work, "as_text"), os.path.join(work, "as_tokens")
    subprocess.run(shape + ["--steps", "12", "--text", text_path, "--export", as_text],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(shape + ["--steps", "12", "--tokens", tokens_path, "--vocab",
                            str(len(id_of_byte)), "--export", as_tokens],
                   check=True, stdout=subprocess.DEVNULL)
    for name in ("model.safetensors", "config.json"):
        with open(os.path.join(as_text, name), "rb") as a, \
                open(os.path.join(as_tokens, name), "rb") as b:
            assert a.read() == b.read(), f"{name}: --tokens trained otherwise than --text"
    assert not os.path.exists(os.path.join(as_tokens, "vocab.json"))
    # Into the text run's export: its vocab.json would describe another model, and goes.
    assert os.path.exists(os.path.join(as_text, "vocab.json"))
    subprocess.run(shape + ["--steps", "1", "--tokens", tokens_path, "--vocab",
                            str(len(id_of_byte)), "--export", as_text],
                   check=True, stdout=subprocess.DEVNULL)
    assert not os.path.exists(os.path.join(as_text, "vocab.json"))
    print("a text and a token file of its ids: the same exported model, byte for byte")

    # Ids above a byte's, in two training files and a validation file: transformers on the
    # export computes zp_gpt's --eval loss, and the numpy GPT-2 continues --prompt greedily as
    # zp_gpt's --sample does.
    vocab = 300
    period = rng.choice(np.arange(256, vocab), size=12, replace=False).tolist()
    shards = []
    for k, n in enumerate((700, 500)):
        shards.append(os.path.join(work, f"train_{k}.bin"))
        start = int(rng.integers(len(period)))
        write_tokens(shards[-1], [period[(start + i) % len(period)] for i in range(n)])
    val = [period[(5 + i) % len(period)] for i in range(40)] + rng.integers(0, vocab, 21).tolist()
    val_path, out = os.path.join(work, "val.bin"), os.path.join(work, "tokens_trained")
    write_tokens(val_path, val)
    prompt = period[:3]
    r = subprocess.run(shape + ["--steps", "60", "--tokens", shards[0], "--tokens", shards[1],
                                "--vocab", str(vocab), "--eval", val_path, "--export", out,
                                "--sample", "8", "--temperature", "0", "--prompt",
                                " ".join(map(str, prompt))],
                       check=True, capture_output=True, text=True)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == vocab, cfg
    model = GPT2LMHeadModel.from_pretrained(out).eval()
    loss_zp, loss_hf = zp_eval_loss(r.stdout), transformers_eval_loss(model, val, 16)
    print(f"--tokens (vocabulary {vocab}, 2 files): eval loss {loss_zp:.7f} (zp), {loss_hf:.7f} "
          f"(transformers on the export)")
    assert abs(loss_zp - loss_hf) <= 1e-5 * abs(loss_hf), (loss_zp, loss_hf)
    lines = r.stdout.splitlines()
    sample = lines[lines.index(next(ln for ln in lines if ln.startswith("sample ("))) + 1]
    said, generated = sample.split(" | ")
    assert [int(t) for t in said.split()] == prompt, sample
    weights, want = load_file(os.path.join(out, "model.safetensors")), list(prompt)
    for _ in range(8):
        want.append(int(gpt2_logits(weights, cfg, np.array([want[-16:]]))[0, -1].argmax()))
    assert [int(t) for t in generated.split()] == want[3:], (sample, want)
    assert want[3:] == period[3:11], f"the pattern {period} was not learned: {sample}"
    print(f"--sample 8 --prompt '{said}': {generated}, the pattern, as the numpy GPT-2 "
          f"continues it")

    # A validation file of one token, a token outside --vocab, a prompt of another id than a
    # token's: refused before training.
    args = shape + ["--tokens", shards[0], "--vocab", str(vocab), "--eval", val_path]
    for ids_, more, needle in (
            ([7], [], f"--eval {val_path} is too short: 1 token(s)"),
            ([1, vocab], [], f"token file {val_path} has the token {vocab} at position 1, not "
                             f"below the vocabulary ({vocab})"),
            ([1, 2], ["--sample", "3", "--prompt", "12, 300"],
             f"--prompt: '300' is not a token id in [0, {vocab})")):
        write_tokens(val_path, ids_)
        r = subprocess.run(args + more, capture_output=True, text=True)
        assert r.returncode == 1 and needle in r.stderr, (needle, r.returncode, r.stderr)
        assert "step" not in r.stdout, r.stdout
    print("--eval of one token, of a token outside the vocabulary, a prompt of another id: "
          "refused")


def main():
    exporter, work = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:
        check_trained(sys.argv[3], work)
        check_tokens(sys.argv[3], work)
    seed = fresh_seed("the exported model")
    subprocess.run([exporter, work, str(seed)], check=True)
    hf = os.path.join(work, "hf")
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"], cfg
    assert cfg["tie_word_embeddings"] is False and cfg["activation_function"] == "gelu_new", cfg
    weights = load_file(os.path.join(hf, "model.safetensors"))
    d, v, c = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    expected_shapes = {"transformer.wte.weight": (v, d), "transformer.wpe.weight": (c, d),
                       "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,),
                       "lm_head.weight": (v, d)}
    for layer in range(cfg["n_layer"]):
        p = f"transformer.h.{layer}."
        for name, shape in {"ln_1.weight": (d,), "ln_1.bias": (d,), "attn.c_attn.weight": (d, 3 * d),
                            "attn.c_attn.bias": (3 * d,), "attn.c_proj.weight": (d, d),
                            "attn.c_proj.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
                            "mlp.c_fc.weight": (d, 4 * d), "mlp.c_fc.bias": (4 * d,),
                            "mlp.c_proj.weight": (4 * d, d), "mlp.c_proj.bias": (d,)}.items():
            expected_shapes[p + name] = shape
    got_shapes = {k: tuple(a.shape) for k, a in weights.items()}
    assert got_shapes == expected_shapes, f"tensors differ:\n{got_shapes}\n{expected_shapes}"
    expected = load_file(os.path.join(work, "expected.safetensors"))
    tokens, logits = expected["tokens"].astype(np.int64), expected["logits"].astype(np.float64)
    ref = gpt2_logits(weights, cfg, tokens)
    err = rel_err(logits, ref)
    print(f"zp's logits against a float64 GPT-2 of Hugging Face's layout: relative error {err:.2e}")
    assert err < 1e-5, err
    model = GPT2LMHeadModel.from_pretrained(hf).eval()
    with torch.no_grad():
        out = model(torch.from_numpy(tokens)).logits.double().numpy()
    err = rel_err(logits, out)
    print(f"zp's logits against transformers' GPT2LMHeadModel: relative error {err:.2e}")
    assert err < 1e-5, err

    # The other way: a GPT-2 that transformers initialises and saves (tied head, more positions
    # than zp's context), read as zp_gpt --init-from reads it: zp's loss of predicting each next
    # token equals transformers' (labels=tokens) on the same tokens, and so do the logits.
    saved = os.path.join(work, "from_transformers")
    model = save_transformers_gpt2(saved, seed, vocab_size=cfg["vocab_size"], n_positions=4 * c,
                                   n_embd=d, n_layer=cfg["n_layer"], n_head=cfg["n_head"])
    again = os.path.join(work, "zp_from_transformers")
    subprocess.run([exporter, again, str(seed), saved], check=True)
    expected = load_file(os.path.join(again, "expected.safetensors"))
    tokens = torch.from_numpy(expected["tokens"].astype(np.int64))
    with torch.no_grad():
        out = model(tokens, labels=tokens)
    loss_zp, loss_hf = float(expected["loss"][0]), float(out.loss)
    print(f"transformers' own GPT-2 loaded into zp: loss {loss_zp:.7f} (zp), {loss_hf:.7f} "
          f"(transformers); logits relative error "
          f"{rel_err(expected['logits'].astype(np.float64), out.logits.double().numpy()):.2e}")
    assert abs(loss_zp - loss_hf) <= 1e-5 * abs(loss_hf), (loss_zp, loss_hf)
    assert rel_err(expected["logits"].astype(np.float64), out.logits.double().numpy()) < 1e-5


if __name__ == "__main__":
    main()
