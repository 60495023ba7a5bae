"""`appliance tune`: hyperparameter search on Optuna, each trial a real `appliance train` run."""
