"""The long-document set: digests of articles with their highlights in order, reference topics, coverage."""

import json

import pytest

from nugget_rag.eval.long_documents import TOPIC_TERMS, digests, highlight_words, reference_topics

ARTICLES = [("Frida Kahlo's photographs", "Frida Kahlo was a Mexican artist .\nA book shows photographs by Gisele Freund ."),
            ("Everest climb", "Alison Hargreaves climbed Everest .\nShe was from Derbyshire ."),
            ("Cardiff rugby", "Gethin Jenkins is a doubt for Cardiff Blues .\nThe Blues play Glasgow ."),
            ("Kahlo again", "Frida Kahlo painted in Mexico City .\nHer house is a museum .")]


@pytest.fixture
def news(tmp_path):
    path = tmp_path / "news.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "article": f"{title}. Body text {i}.", "highlights": hl}) + "\n"
                            for i, (title, hl) in enumerate(ARTICLES)))
    return path


def test_digest_joins_articles_and_their_highlights_in_order(news):
    (digest,) = digests(news, None, size=4, count=1)
    assert [digest.text.index(f"Body text {i}") for i in range(4)] == sorted(digest.text.index(f"Body text {i}")
                                                                          for i in range(4))
    assert digest.reference.splitlines()[0] == "Frida Kahlo was a Mexican artist ."
    # a name two articles share (Frida, Kahlo) names neither; each article keeps what is its own
    assert "Kahlo" not in digest.article_words[0] and "Gisele" in digest.article_words[0]
    assert digest.coverage("Alison Hargreaves and the Cardiff Blues.") == (0.5, ["2", "3"])
    assert digest.coverage("Gisele's photographs") == (0.25, ["1"])  # a possessive still names her


def test_digests_are_seeded_samples_and_refuse_too_few(news):
    assert [d.text for d in digests(news, None, size=2, count=3)] == [d.text for d in digests(news, None, 2, 3)]
    assert len({d.text for d in digests(news, None, size=2, count=3)}) > 1
    with pytest.raises(ValueError, match="needs 5"):
        digests(news, None, size=5)


def test_highlight_words_leave_out_common_openers():
    assert highlight_words("The Blues play Glasgow .\nPolice say He left .") == {"Blues", "Glasgow"}


def test_topics_cover_their_key_terms():
    (compound,) = reference_topics(["compound"])
    assert len(compound.text) > 40_000 and compound.reference is None
    share, named = compound.coverage('The "if" statement, the for loop, try/except, with statements and classes.')
    assert named == ["if", "for", "try", "with", "class definitions"] and share == 5 / len(TOPIC_TERMS["compound"])
    assert compound.coverage("If it rains, we stay in.")[1] == []  # English "if" is not the statement
    with pytest.raises(ValueError, match="no key terms"):
        reference_topics(["lambda"])
