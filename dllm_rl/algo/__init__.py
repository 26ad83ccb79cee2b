"""Pure tensor functions of the RL step: advantage estimators, policy losses, KL estimators, loss aggregation."""
