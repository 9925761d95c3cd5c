"""The model card (README.md) of an export folder: architecture, attention mixers and their learned mixture
weights, training data, steps, tokens seen, the run's evaluation results, and how to load and fine-tune it.

Its `pipeline_tag` is `text-generation`: transformers 5 removed the `text2text-generation` task that T5 cards named
(its pipeline says "use the text-generation pipeline"), and that pipeline generates with an export in 4.57 and 5.24
alike (logging that T5 is not among its causal LMs): given the folder of a vanilla one, the loaded model of a
Synthesizer one (for a folder it looks for a causal LM in auto_map)."""
from __future__ import annotations

from pretrain.core.config import ModelConfig
from pretrain.model.hf_convert import is_hf_t5
from pretrain.model.mixers import MIXERS, parse_mixers

PIPELINE_TAG = "text-generation"
FINE_TUNING_DROPOUT = 0.1  # T5 v1.1's dropout_rate for fine-tuning; pretraining (and so the export) runs without
# transformers 5 sets tie_word_embeddings on every T5Config, so resize_token_embeddings and tie_weights() replace
# v1.1's own lm_head with the input embedding (a transformers bug); this line before them keeps it (4.x reads the
# export's false and ties nothing). The remote-code class of a Synthesizer export keeps lm_head out by itself.
UNTIE = "model.config.tie_word_embeddings = False"
PRETRAINING_METRICS = {  # what pretraining's metrics.jsonl measures on data.valid, teacher-forced span corruption
    "eval_loss": "cross-entropy per target token",
    "eval_accuracy": "share of target tokens whose argmax is right: a pretraining measure, not a task score",
}

POSITION_BIAS_TEXT = {  # model.position_bias (docs/model.md, "Position bias")
    "all": "T5's, added to every self-attention's mixed logits (`position_bias: all`)",
    "vanilla": "T5's, on the dot-product logits only, before mixing (`position_bias: vanilla`)",
    "none": "none: self-attention sees no positions but the decoder's causal mask (`position_bias: none`)",
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


def _fine_tuning(name: str, synthesizer: bool, dropout: float) -> list[str]:
    """What an HF fine-tuning should know: dropout, and (vanilla) how to add tokens without losing lm_head."""
    remote = ", trust_remote_code=True" if synthesizer else ""
    lines = ["", "## Fine-tuning", "",
             f"The config's `dropout_rate` is {dropout}, pretraining's; T5 v1.1 fine-tunes with {FINE_TUNING_DROPOUT}: "
             f'`AutoModelForSeq2SeqLM.from_pretrained("{name}"{remote}, dropout_rate={FINE_TUNING_DROPOUT})`.']
    if not synthesizer:
        lines += ["", "The output embedding (`lm_head`) is trained apart from the input embedding. Under transformers "
                  "5, `resize_token_embeddings` (and `tie_weights()`) replace it with the input embedding; before "
                  f"adding tokens run `{UNTIE}`."]
    return lines


def model_card(cfg: ModelConfig, num_params: int, mixture: dict[str, list], source: dict, name: str) -> str:
    """README.md text; `mixture`: softmax mixture weights per layer, `source`: step, tokens_seen, data, evaluation."""
    synthesizer = (cfg.encoder_attention, cfg.decoder_attention) != ("vanilla", "vanilla")
    remote = not is_hf_t5(cfg)  # the remote code: Synthesizer models, and vanilla ones without T5's position bias
    used = set(parse_mixers(cfg.encoder_attention)) | set(parse_mixers(cfg.decoder_attention))
    mixers = [m for m in MIXERS if m in used]
    lines = [
        "---", "library_name: transformers", f"pipeline_tag: {PIPELINE_TAG}",
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
        f"| relative position bias | {POSITION_BIAS_TEXT[cfg.position_bias]} |",
    ]
    if synthesizer:
        lines += [f"| maximum length N | {cfg.max_length} (longer inputs are refused) |",
                  f"| mixture weights | {'per head' if cfg.mixture_per_head else 'per layer'} |"]
    lines += ["", "Attention mixers:", *[f"- `{m}`: {MIXERS[m].text}" for m in mixers]]
    if mixture:
        lines += ["", "Learned mixture weights (softmax; per-head weights averaged over heads):", ""]
        for layer, w in mixture.items():
            stack = layer.split(".")[0]
            rows = w if isinstance(w[0], list) else [w]
            mean = [sum(r[i] for r in rows) / len(rows) for i in range(len(rows[0]))]
            spec = parse_mixers(getattr(cfg, f"{stack}_attention"))
            lines.append(f"- {layer}: " + ", ".join(f"{m} {v:.3f}" for m, v in zip(spec, mean)))
    labels = {"data": "data", "step": "steps", "tokens_seen": "tokens seen", "run": "run",
              "checkpoint": "checkpoint (in the run folder)"}
    training = [f"- {label}: {source[key]:,}" if isinstance(source[key], int) else f"- {label}: {source[key]}"
                for key, label in labels.items() if source.get(key) not in (None, "")]
    lines += ["", "## Training", "", *(training or ["Not recorded (exported from a model in memory)."])]
    lines += ["", "## Evaluation", "", *_evaluation(source.get("evaluation") or {})]
    lines += _fine_tuning(name, remote, cfg.dropout)
    lines += ["", "## How to load", "", "```python", _loading(name, remote),
              'ids = tokenizer("sst2 sentence: a gorgeous film", return_tensors="pt").input_ids',
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=8)[0], skip_special_tokens=True))",
              "```", "",
              "Or with this project: `pretrain.transfer.exporting.load_pretrained(FOLDER)`; fine-tune with "
              "`python -m pretrain.finetune ... init=FOLDER`.", ""]
    return "\n".join(lines)


def _evaluation(evaluation: dict[str, float]) -> list[str]:
    """Pretraining's held-out measures (`eval_*` of metrics.jsonl), said to be such, then the tasks' scores."""
    pretraining = {k: v for k, v in evaluation.items() if k.startswith("eval_")}
    tasks = {k: v for k, v in evaluation.items() if k not in pretraining}
    lines = []
    if pretraining:
        lines += ["Pretraining, on the held-out shards (data.valid): span-corruption targets, teacher-forced.", "",
                  "| metric | value | meaning |", "|---|---|---|",
                  *[f"| {k} | {v:.4g} | {PRETRAINING_METRICS.get(k, '')} |" for k, v in sorted(pretraining.items())]]
    if tasks:
        lines += [*([""] if lines else []), "Fine-tuned tasks (the run's results.json):", "",
                  "| task/metric | value |", "|---|---|", *[f"| {k} | {v:.4g} |" for k, v in sorted(tasks.items())]]
    return lines or ["No evaluation results were recorded by the run."]
