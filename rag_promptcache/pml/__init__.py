"""PML, the Prompt Markup Language of Prompt Cache (paper §3.2): schemas, modules, params, unions,
roles, and prompts that import them. Parsing and validation only; tokens and positions live in the
engine."""

from rag_promptcache.pml.ast import (
    Import,
    Module,
    Param,
    Prompt,
    Role,
    Schema,
    Text,
    Union,
)
from rag_promptcache.pml.errors import PMLError
from rag_promptcache.pml.build import to_pml
from rag_promptcache.pml.parser import escape, parse_prompt, parse_schema, unescape

__all__ = [
    "Import", "Module", "Param", "PMLError", "Prompt", "Role", "Schema", "Text", "Union",
    "escape", "parse_prompt", "parse_schema", "to_pml", "unescape",
]
