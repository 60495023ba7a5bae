"""What an installed site carries next to its venv: pretrained weights, tuning databases, the
prebuilt edge runner. Core layer: the bundle builds them, training and deploy use them."""
