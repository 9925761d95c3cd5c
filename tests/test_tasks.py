"""Task readers on small files in the official GLUE/SuperGLUE formats, malformed files, and submission files."""
import json

import pytest

from pretrain.tasks import TASKS, TaskFileError, get_task
from pretrain.tasks.submission import write_submission

# One labelled row and one test row per GLUE task, in the official download's columns and order.
GLUE_FILES = {
    "cola": (
        "gj04\t1\t\tOur friends won't buy this analysis.\n",
        "index\tsentence\n0\tBill whistled past the house.\n",
        "cola sentence: Our friends won't buy this analysis.", "acceptable",
    ),
    "sst2": (
        "sentence\tlabel\nit 's a charming and often affecting journey . \t1\n",
        "index\tsentence\n0\tuneasy mishmash of styles and genres .\n",
        "sst2 sentence: it 's a charming and often affecting journey . ", "positive",
    ),
    "mrpc": (
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t1\t2\tHe said \"no\".\tHe said yes.\n",
        "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n0\t3\t4\tA a.\tB b.\n",
        'mrpc sentence1: He said "no". sentence2: He said yes.', "not_equivalent",
    ),
    "stsb": (
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
        "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t3.79\n",
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\n"
        "0\tmain-news\theadlines\t2016\t0001\tnone\tnone\tA.\tB.\n",
        "stsb sentence1: A plane is taking off. sentence2: An air plane is taking off.", "3.8",
    ),
    "qqp": (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n7\t15\t16\tHow do I?\tHow can I?\t1\n",
        "id\tquestion1\tquestion2\n0\tWhy?\tWhy not?\n",
        "qqp question1: How do I? question2: How can I?", "duplicate",
    ),
    "qnli": (
        "index\tquestion\tsentence\tlabel\n0\tWhat?\tThat.\tnot_entailment\n",
        "index\tquestion\tsentence\n0\tWho?\tHim.\n",
        "qnli question: What? sentence: That.", "not_entailment",
    ),
    "rte": (
        "index\tsentence1\tsentence2\tlabel\n0\tA dog runs.\tAn animal runs.\tentailment\n",
        "index\tsentence1\tsentence2\n0\tA.\tB.\n",
        "rte sentence1: A dog runs. sentence2: An animal runs.", "entailment",
    ),
    "wnli": (
        "index\tsentence1\tsentence2\tlabel\n0\tI stuck a pin.\tThe pin stuck.\t1\n",
        "index\tsentence1\tsentence2\n0\tA.\tB.\n",
        "wnli sentence1: I stuck a pin. sentence2: The pin stuck.", "entailment",
    ),
}

MNLI_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
    "sentence2_parse\tsentence1\tsentence2"
)


@pytest.mark.parametrize("name", sorted(GLUE_FILES))
def test_glue_reader_official_format(tmp_path, name):
    train, test, inputs, target = GLUE_FILES[name]
    task = get_task(name)
    (tmp_path / "train.tsv").write_text(train)
    (tmp_path / "test.tsv").write_text(test)
    [ex] = task.read(tmp_path, "train.tsv", labelled=True)
    assert (ex.inputs, ex.target) == (inputs, target)
    [t] = task.read(tmp_path, "test.tsv", labelled=False)
    assert t.label is None and t.target == "" and str(t.idx) == "0"


def test_mnli_dev_with_five_annotator_labels(tmp_path):
    row = "0\t1\t1n\tfiction\t(a)\t(b)\t(A)\t(B)\tThe cat sat.\tA cat sat.\t"
    (tmp_path / "dev_matched.tsv").write_text(
        MNLI_HEADER + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n"
        + row + "entailment\tentailment\tneutral\tentailment\tentailment\tentailment\n"
    )
    [ex] = get_task("mnli").read(tmp_path, "dev_matched.tsv", labelled=True)
    assert ex.inputs == "mnli hypothesis: A cat sat. premise: The cat sat."
    assert (ex.target, ex.label) == ("entailment", 0)


SUPERGLUE_RECORDS = {
    "boolq": ({"question": "is it", "passage": "It is.", "idx": 0, "label": True},
              "boolq passage: It is. question: is it", "True"),
    "cb": ({"premise": "P.", "hypothesis": "H.", "label": "neutral", "idx": 0},
           "cb hypothesis: H. premise: P.", "neutral"),
    "copa": ({"premise": "It rained.", "choice1": "Wet.", "choice2": "Dry.", "question": "effect", "idx": 0, "label": 0},
             "copa choice1: Wet. choice2: Dry. premise: It rained. question: effect", "choice1"),
    "rte_superglue": ({"premise": "P.", "hypothesis": "H.", "label": "not_entailment", "idx": 0},
                      "rte hypothesis: H. premise: P.", "not_entailment"),
    "wic": ({"word": "bank", "sentence1": "S1.", "sentence2": "S2.", "start1": 0, "end1": 4, "start2": 0, "end2": 4,
             "idx": 0, "label": False}, "wic sentence1: S1. sentence2: S2. word: bank", "False"),
    "wsc": ({"text": "Mark told Pete he was late.", "idx": 0, "label": True,
             "target": {"span1_index": 0, "span1_text": "Mark", "span2_index": 3, "span2_text": "he"}},
            "wsc text: Mark told Pete he was late. span1: Mark span2: he", "True"),
}


@pytest.mark.parametrize("name", sorted(SUPERGLUE_RECORDS))
def test_superglue_reader_official_format(tmp_path, name):
    record, inputs, target = SUPERGLUE_RECORDS[name]
    (tmp_path / "val.jsonl").write_text(json.dumps(record) + "\n")
    [ex] = get_task(name).read(tmp_path, "val.jsonl", labelled=True)
    assert (ex.inputs, ex.target, ex.idx) == (inputs, target, 0)


MULTIRC = {"idx": 3, "version": 1.1, "passage": {"text": "Sam ate.", "questions": [
    {"question": "Who ate?", "idx": 0, "answers": [{"text": "Sam", "idx": 0, "label": 1}, {"text": "Al", "idx": 1, "label": 0}]},
    {"question": "What?", "idx": 1, "answers": [{"text": "Food", "idx": 2, "label": 1}]},
]}}


def test_multirc_one_example_per_answer_and_nested_submission(tmp_path):
    (tmp_path / "val.jsonl").write_text(json.dumps(MULTIRC) + "\n")
    task = get_task("multirc")
    examples = task.read(tmp_path, "val.jsonl", labelled=True)
    assert [e.inputs for e in examples][1] == "multirc question: Who ate? answer: Al paragraph: Sam ate."
    assert [e.label for e in examples] == [1, 0, 1]
    assert [e.group for e in examples] == [(3, 0), (3, 0), (3, 1)]
    path = write_submission(task, task.splits[0], examples, [1, 1, 0], tmp_path / "sub")
    assert json.loads(path.read_text()) == {"idx": 3, "passage": {"questions": [
        {"idx": 0, "answers": [{"idx": 0, "label": 1}, {"idx": 1, "label": 1}]},
        {"idx": 1, "answers": [{"idx": 2, "label": 0}]},
    ]}}


@pytest.mark.parametrize(
    "task, file, text, expected",
    [
        ("sst2", "train.tsv", "sentence\tlabel\ngood\t1\tx\n", "train.tsv line 2: expected 2 tab-separated fields (sentence, label), found 3"),
        ("sst2", "train.tsv", "text\tlabel\ngood\t1\n", "train.tsv line 2: expected columns sentence, label; missing sentence"),
        ("sst2", "train.tsv", "sentence\tlabel\ngood\tpositive\n", "train.tsv line 2: label 'positive' is not one of '0', '1'"),
        ("stsb", "train.tsv", "sentence1\tsentence2\tscore\na\tb\thigh\n", "train.tsv line 2: label 'high' is not a number"),
        # accepted before (issue 45): STS-B's scores are 0 to 5
        ("stsb", "train.tsv", "sentence1\tsentence2\tscore\na\tb\t7.3\n", "train.tsv line 2: label '7.3' is outside the task's scores, 0 to 5"),
        ("stsb", "dev.tsv", "sentence1\tsentence2\tscore\na\tb\t-2\n", "dev.tsv line 2: label '-2' is outside the task's scores, 0 to 5"),
        ("sst2", "train.tsv", "", "train.tsv: empty file; expected a header line"),
        ("cb", "val.jsonl", '{"premise": "p", "label": "neutral"}\n', "val.jsonl line 1: expected fields premise, hypothesis, label; missing hypothesis"),
        ("cb", "val.jsonl", '{"premise": "p",\n', "val.jsonl line 1: not a JSON object"),
        ("wsc", "val.jsonl", '{"text": "t", "target": {"span1_text": "a"}, "label": true}\n', "val.jsonl line 1: expected the official WSC fields; missing 'span2_text'"),
    ],
)
def test_malformed_files_are_one_line_errors(tmp_path, task, file, text, expected):
    (tmp_path / file).write_text(text)
    with pytest.raises(TaskFileError) as e:
        get_task(task).read(tmp_path, file, labelled=True)
    assert str(tmp_path / file) in str(e.value) and expected in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(TaskFileError, match=r"dev\.tsv: file not found; expected the official SST-2 dev\.tsv"):
        get_task("sst2").read(tmp_path, "dev.tsv", labelled=True)
    with pytest.raises(ValueError, match="unknown task 'sst'; choose one of cola, sst2"):
        get_task("sst")


def test_glue_and_superglue_submission_formats(tmp_path):
    sst2, boolq, stsb = get_task("sst2"), get_task("boolq"), get_task("stsb")
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\ta\n1\tb\n")
    examples = sst2.read(tmp_path, "test.tsv", labelled=False)
    path = write_submission(sst2, sst2.splits[0], examples, [1, -1], tmp_path / "sub")
    assert path.name == "SST-2.tsv" and path.read_text() == "index\tprediction\n0\t1\n1\t0\n"
    (tmp_path / "test.jsonl").write_text('{"question": "q", "passage": "p", "idx": 5}\n')
    examples = boolq.read(tmp_path, "test.jsonl", labelled=False)
    path = write_submission(boolq, boolq.splits[0], examples, [1], tmp_path / "sub")
    assert path.name == "BoolQ.jsonl" and json.loads(path.read_text()) == {"idx": 5, "label": "true"}
    path = write_submission(stsb, stsb.splits[0], examples, [5.7], tmp_path / "sub")
    assert path.read_text().splitlines()[1] == "5\t5.0"


def test_every_task_has_label_words_metrics_and_splits():
    assert len(TASKS) == 17  # GLUE, SuperGLUE and the study's span probe (pair)
    for task in TASKS.values():
        assert task.splits and task.metrics and task.label_words
        assert task.regression or len(task.raw_labels) == len(task.label_words)
