"""The stand-in's domains: a toy shop under the name "retail" (vllm-project/vime's TAU_CONFIGS asks for
it) and a one-flight toy under "airline" (tau1_mock.py lists its test split). Their texts are
short on purpose: vllm-project/vime's agent puts the wiki and every tool's schema in the system prompt,
and the tests run it on a tiny model with a character tokenizer (ASCII only)."""

from __future__ import annotations

import json
from typing import Any

from tau_bench.types import Action, Task


def _info(name: str, description: str, **params: str) -> dict[str, Any]:
    """A tool's schema in the OpenAI function format tau-bench's `tools_info` uses."""
    props = {p: {"type": "string", "description": d} for p, d in params.items()}
    schema = {"type": "object", "properties": props, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def find_user_id_by_email(data: dict[str, Any], email: str) -> str:
    for user_id, user in data["users"].items():
        if user["email"] == email:
            return user_id
    return "Error: user not found"


def get_order_details(data: dict[str, Any], order_id: str) -> str:
    if order_id not in data["orders"]:
        return "Error: order not found"
    return json.dumps(data["orders"][order_id])


def cancel_pending_order(data: dict[str, Any], order_id: str) -> str:
    order = data["orders"].get(order_id)
    if order is None:
        return "Error: order not found"
    if order["status"] != "pending":
        return f"Error: order is {order['status']}, only a pending order can be cancelled"
    order["status"] = "cancelled"
    return json.dumps(order)


SHOP_DATA = {
    "users": {"ann_1": {"email": "ann@x.com"}, "bo_2": {"email": "bo@x.com"}},
    "orders": {
        "#W1": {"user_id": "ann_1", "status": "pending", "items": 3},
        "#W2": {"user_id": "ann_1", "status": "delivered", "items": 2},
        "#W3": {"user_id": "bo_2", "status": "pending", "items": 5},
        "#W4": {"user_id": "bo_2", "status": "pending", "items": 1},
    },
}
SHOP_TOOLS = {
    "find_user_id_by_email": (find_user_id_by_email, _info("find_user_id_by_email", "user id", email="email")),
    "get_order_details": (get_order_details, _info("get_order_details", "order status, items", order_id="#W1")),
    "cancel_pending_order": (cancel_pending_order, _info("cancel_pending_order", "cancel", order_id="#W1")),
}
SHOP_WIKI = "You are a shop agent. Check the user's email before acting on an order."


def _cancel(order: str, email: str) -> Task:
    return Task(
        user_id=email,
        actions=[Action(name="cancel_pending_order", kwargs={"order_id": order})],
        instruction=f"Please cancel order {order}.\nMy email is {email}.",
        outputs=[],
    )


def _count(order: str, email: str, items: int) -> Task:
    return Task(
        user_id=email,
        actions=[Action(name="get_order_details", kwargs={"order_id": order})],
        instruction=f"How many items are in order {order}?\nMy email is {email}.",
        outputs=[str(items)],
    )


# train: mostly questions (a random policy answers one by luck now and then, so a group's rewards
# differ and GRPO has a signal), two cancellations (which need the tool called right)
SHOP_TASKS = {
    "train": [
        _cancel("#W1", "ann@x.com"),
        _count("#W2", "ann@x.com", 2),
        _count("#W4", "bo@x.com", 1),
        _count("#W1", "ann@x.com", 3),
        _cancel("#W3", "bo@x.com"),
        _count("#W3", "bo@x.com", 5),
        _count("#W2", "bo@x.com", 2),
        _count("#W4", "ann@x.com", 1),
    ],
    "dev": [_cancel("#W4", "bo@x.com"), _count("#W1", "ann@x.com", 3)],
    "test": [_count("#W3", "bo@x.com", 5)],
}


def get_flight(data: dict[str, Any], flight: str) -> str:
    return json.dumps(data["flights"][flight]) if flight in data["flights"] else "Error: flight not found"


AIRLINE_DATA = {"flights": {"F1": {"seats_left": 4}}}
AIRLINE_TOOLS = {"get_flight": (get_flight, _info("get_flight", "seats left", flight="F1"))}
AIRLINE_WIKI = "You are an airline agent."
AIRLINE_TASKS = {
    "test": [
        Task(
            user_id="cy",
            actions=[Action(name="get_flight", kwargs={"flight": "F1"})],
            instruction="How many seats are left on F1?",
            outputs=["4"],
        )
    ]
}

DOMAINS = {
    "retail": (SHOP_DATA, SHOP_TOOLS, SHOP_TASKS, SHOP_WIKI),
    "airline": (AIRLINE_DATA, AIRLINE_TOOLS, AIRLINE_TASKS, AIRLINE_WIKI),
}
