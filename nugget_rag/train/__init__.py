"""Training: `nugget-rag train` (nugget_rag/train/cli.py), the Trainer, objectives, data, distillation."""
