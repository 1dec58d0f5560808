"""A plug-in tool for `tools.<name>.function`: arithmetic on the numbers the model writes.

    tandem train CONFIG tools.calculator.function=examples/extending/calculator_tool.py:calculate

The model writes `<calculator> 12 * (3 + 4) </calculator>`; generation stops at the closing tag, and the
agent loop inserts `<result>84</result>` (masked from the loss, like search results) before the next
turn. The function gets the text between the tags and returns text; an exception becomes an error
text for the model (`tool calculator failed: ...`), counted in the trajectory's `num_tool_errors`.
"""

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 100


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); nothing else is
    evaluated, so the model cannot run code through it."""
    value = _eval(ast.parse(expression.strip(), mode="eval").body)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _eval(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_eval(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
