"""The core: small modules every layer may use (errors, manifests, TOML configs, values, progress,
locks, the HTML report frame). No heavy imports here."""
