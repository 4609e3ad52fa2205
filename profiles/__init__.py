"""YAML hardware and model profiles, loaded by engine.plan.profiles."""
