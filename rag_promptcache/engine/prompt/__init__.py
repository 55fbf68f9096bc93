"""PML compiled for a model: schemas and prompts into token pieces (the first step of a request)."""
