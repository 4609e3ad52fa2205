"""YAML hardware and model profiles, loaded by engine.profiles."""
