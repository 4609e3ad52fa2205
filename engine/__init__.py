"""specache engine: document -> tokens -> chunked prefill -> host store + guide -> speculative decode -> text."""
