"""Attribute docstrings (PEP 224: a string right under an annotated field), read from source.

One reader for the two places that need them: config help text (`rlbus.configs.base`) and the
bus message reference (`rlbus_launch.schema`).
"""

import ast


def attribute_docstrings(node: ast.ClassDef) -> dict[str, str]:
    """Field name -> the string literal right under its annotated declaration in class `node`."""
    docs: dict[str, str] = {}
    for statement, following in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = following.value.value
    return docs
