"""Launch integrations: zerojax composing with the frameworks users train with (Hugging Face
accelerate, ...), one module per framework. Each module imports its framework itself, and only
when it is used; nothing is imported here.
"""
