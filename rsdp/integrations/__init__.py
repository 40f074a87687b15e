"""Integrations with other libraries' training loops; each module imports its library on import
(``rsdp.integrations.transformers`` needs transformers and accelerate)."""
