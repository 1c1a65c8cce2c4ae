"""Klique's content negotiation (apps.core.negotiation) answers exactly as DRF's: the same renderer and
media type, or the same refusal, for every Accept header, format and list of renderers below; and the
common case is answered without DRF's parsing."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import Http404
from rest_framework import exceptions
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.test import APIRequestFactory

from apps.core.negotiation import ContentNegotiation


class CsvRenderer(BaseRenderer):
    media_type = "text/csv; charset=utf-8"  # a media type with a parameter, which `*/*` does not match
    format = "csv"


class AnyRenderer(BaseRenderer):
    media_type = "*/*"
    format = "any"


ACCEPTS = [
    None,  # no Accept header: DRF takes it as */*
    "*/*",
    "  */*  ",
    "",
    "application/json",
    "application/json; indent=4",
    "APPLICATION/JSON",
    "text/html",
    "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
    "application/*",
    "*/*;q=0.1",
    "application/json, */*",
    "text/csv; charset=utf-8",
    "text/csv",
    "image/png",
    "x" * 300,
    "*/*, " * 100,
]
FORMATS = ["", "?format=json", "?format=api", "?format=csv", "?format=", "?other=1"]
RENDERERS: list[list[type[BaseRenderer]]] = [
    [JSONRenderer, BrowsableAPIRenderer],
    [BrowsableAPIRenderer, JSONRenderer],
    [CsvRenderer, JSONRenderer],
    [AnyRenderer, JSONRenderer],
    [JSONRenderer],
    [],
]


def answer(negotiation: DefaultContentNegotiation, **asked: Any) -> tuple[Any, ...]:
    headers = {} if asked["accept"] is None else {"HTTP_ACCEPT": asked["accept"]}
    request = Request(APIRequestFactory().get(f"/api/v1/me/{asked['query']}", **headers))
    renderers = [renderer() for renderer in asked["renderers"]]
    try:
        renderer, media_type = negotiation.select_renderer(request, renderers, asked["suffix"])
    except (exceptions.NotAcceptable, Http404) as refused:
        return ("refused", type(refused))
    return (type(renderer), media_type)


@pytest.mark.parametrize("renderers", RENDERERS, ids=lambda found: "+".join(r.__name__ for r in found))
@pytest.mark.parametrize("suffix", [None, "json"])
def test_every_answer_is_drf_s(renderers: list[type[BaseRenderer]], suffix: str | None) -> None:
    for accept in ACCEPTS:
        for query in FORMATS:
            asked = {"accept": accept, "query": query, "renderers": renderers, "suffix": suffix}
            ours, drf_s = answer(ContentNegotiation(), **asked), answer(DefaultContentNegotiation(), **asked)
            assert ours == drf_s, asked


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
def test_the_common_case_is_answered_without_parsing_the_header(
    accept: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def parsed(*_: Any) -> Any:
        raise AssertionError("the Accept header was parsed")

    monkeypatch.setattr(DefaultContentNegotiation, "_get_parsed_accept_list", parsed)
    found = answer(
        ContentNegotiation(),
        accept=accept,
        query="",
        renderers=[JSONRenderer, BrowsableAPIRenderer],
        suffix=None,
    )
    assert found == (JSONRenderer, "application/json")
    with pytest.raises(AssertionError, match="parsed"):  # any other header is DRF's to parse
        answer(ContentNegotiation(), accept="text/html", query="", renderers=[JSONRenderer], suffix=None)


def test_the_api_negotiates_with_it() -> None:
    negotiation: Any = api_settings.DEFAULT_CONTENT_NEGOTIATION_CLASS
    assert negotiation is ContentNegotiation
