"""Pretrained weights out and back in: export to HuggingFace's layout (exporting, weights_writer,
hf_files, model_card) and the evaluation of a model on a task (evaluation). Imports: everything below it (core,
distributed, model, data, tasks, runtime); never a command or pretrain.experiments."""
