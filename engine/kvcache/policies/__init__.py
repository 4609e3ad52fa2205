"""The cache policies, one module each: every module here is found and imported by
engine.kvcache.registry.discover (no list of them anywhere), and registers its layer class with
`@register("name")`. A new policy is a new file here."""
