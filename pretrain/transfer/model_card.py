"""The model card (README.md) of an export folder: architecture, attention mixers and their learned mixture
weights, training data, steps, tokens seen, the run's evaluation results, and how to load it."""
from __future__ import annotations

from pretrain.core.config import ModelConfig
from pretrain.model.attention import parse_mixers

MIXER_TEXT = {
    "vanilla": "dot-product attention (T5's q k^T)",
    "dense": "Dense Synthesizer: each token synthesizes its row of N logits, W2 relu(W1 x + b1) + b2",
    "random": "Random Synthesizer: a learned N x N logit matrix per head, independent of the input",
    "fixed_random": "Fixed Random Synthesizer: a frozen random N x N logit matrix per head",
    "factorized_dense": "Factorized Dense Synthesizer: two small dense projections whose outer product gives N logits",
    "factorized_random": "Factorized Random Synthesizer: R1 R2^T per head, R1, R2 in R^{N x k}",
}


def _loading(name: str, synthesizer: bool) -> str:
    if not synthesizer:
        return ("from transformers import T5ForConditionalGeneration, T5TokenizerFast\n"
                f'model = T5ForConditionalGeneration.from_pretrained("{name}")  # plain T5 v1.1\n'
                f'tokenizer = T5TokenizerFast.from_pretrained("{name}")')
    return ("from transformers import AutoModelForSeq2SeqLM, T5TokenizerFast\n"
            "# the Synthesizer attention is code shipped in this folder (modeling_synthesizer_t5.py): read it, then\n"
            f'model = AutoModelForSeq2SeqLM.from_pretrained("{name}", trust_remote_code=True)\n'
            f'tokenizer = T5TokenizerFast.from_pretrained("{name}")')


def model_card(cfg: ModelConfig, num_params: int, mixture: dict[str, list], source: dict, name: str) -> str:
    """README.md text; `mixture`: softmax mixture weights per layer, `source`: step, tokens_seen, data, evaluation."""
    synthesizer = (cfg.encoder_attention, cfg.decoder_attention) != ("vanilla", "vanilla")
    used = set(parse_mixers(cfg.encoder_attention)) | set(parse_mixers(cfg.decoder_attention))
    mixers = [m for m in MIXER_TEXT if m in used]
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text2text-generation",
        "tags: [t5, synthesizer]" if synthesizer else "tags: [t5]", "---", f"# {name}", "",
        "A T5 v1.1 encoder-decoder (RMSNorm, gated-GELU feed-forward, relative position bias, untied embeddings) "
        "pretrained with span corruption by synthesizer-pretrain"
        + (", with Synthesizer self-attention (Tay et al. 2021, arXiv 2005.00743)." if synthesizer else "."),
        "", "## Architecture", "", "| | |", "|---|---|",
        f"| parameters | {num_params:,} |",
        f"| layers (encoder / decoder) | {cfg.num_layers} / {cfg.num_decoder_layers} |",
        f"| d_model / d_ff / heads x d_kv | {cfg.d_model} / {cfg.d_ff} / {cfg.num_heads} x {cfg.d_kv} |",
        f"| vocabulary | {cfg.vocab_size} |",
        f"| encoder self-attention | `{cfg.encoder_attention}` |",
        f"| decoder self-attention | `{cfg.decoder_attention}` |",
    ]
    if synthesizer:
        lines += [f"| maximum length N | {cfg.max_length} (longer inputs are refused) |",
                  f"| mixture weights | {'per head' if cfg.mixture_per_head else 'per layer'} |"]
    lines += ["", "Attention mixers:", *[f"- `{m}`: {MIXER_TEXT[m]}" for m in mixers]]
    if mixture:
        lines += ["", "Learned mixture weights (softmax; per-head weights averaged over heads):", ""]
        for layer, w in mixture.items():
            stack = layer.split(".")[0]
            rows = w if isinstance(w[0], list) else [w]
            mean = [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))]
            spec = parse_mixers(getattr(cfg, f"{stack}_attention"))
            lines.append(f"- {layer}: " + ", ".join(f"{m} {v:.3f}" for m, v in zip(spec, mean)))
    labels = {"data": "data", "step": "steps", "tokens_seen": "tokens seen", "checkpoint": "checkpoint"}
    training = [f"- {label}: {source[key]:,}" if isinstance(source[key], int) else f"- {label}: {source[key]}"
                for key, label in labels.items() if source.get(key) not in (None, "")]
    lines += ["", "## Training", "", *(training or ["Not recorded (exported from a model in memory)."])]
    lines += ["", "## Evaluation", ""]
    evaluation = source.get("evaluation") or {}
    if evaluation:
        lines += ["| metric | value |", "|---|---|", *[f"| {k} | {v:.4g} |" for k, v in sorted(evaluation.items())]]
    else:
        lines.append("No evaluation results were recorded by the run.")
    lines += ["", "## How to load", "", "```python", _loading(name, synthesizer),
              'ids = tokenizer("sst2 sentence: a gorgeous film", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=8)[0], skip_special_tokens=True))",
              "```", "",
              "Or with this project: `pretrain.transfer.exporting.load_pretrained(FOLDER)`; fine-tune with "
              "`python -m pretrain.finetune ... init=FOLDER`.", ""]
    return "\n".join(lines)
