"""Training: `nugget-rag train` (nugget_rag/train/cli.py), the Trainer (the loop, trainer.py, with its jobs in their
own modules), objectives, records, examples and batches, distillation."""
