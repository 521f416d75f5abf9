"""Weights & Biases and MLflow trackers for UniRL (``logging.trackers: [wandb, mlflow]``).

Light at import: each library is imported only when its tracker is built."""
