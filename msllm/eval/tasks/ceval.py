"""C-Eval (Huang et al., NeurIPS 2023) by log-likelihood, as lm-evaluation-harness v0.4.13's
``ceval-valid`` group (``lm_eval/tasks/ceval/_default_ceval_yaml``, ``ceval-valid_<subject>.yaml``):

* description ``"以下是中国关于{科目}的单项选择题，请选出其中的正确答案。\\n\\n"`` with the subject's
  Chinese name (table below, copied from the harness's per-subject YAMLs);
* ``doc_to_text``: ``"{question.strip()}\\nA. {A}\\nB. {B}\\nC. {C}\\nD. {D}\\n答案："``;
  choices ``A``..``D`` scored as ``" A"``..``" D"``;
* few-shot: the first n of the ``dev`` split (``first_n``); evaluated split ``val`` (C-Eval's test
  split has no answers);
* metrics ``acc`` and ``acc_norm``.

Files: C-Eval's released layout ``DATA_DIR/{dev,val}/{subject}_{split}.csv`` with the header
``id,question,A,B,C,D,answer`` (dev adds ``explanation``).
"""

from __future__ import annotations

from typing import Optional

from msllm.errors import MsllmError
from msllm.eval.tasks.common import TaskData, letter_index, load_subject_csvs, read_csv

CHOICES = ["A", "B", "C", "D"]
HEADER = ("id", "question", "A", "B", "C", "D", "answer")
SUBJECTS_ZH = {
    "accountant": "注册会计师",
    "advanced_mathematics": "高等数学",
    "art_studies": "艺术学",
    "basic_medicine": "基础医学",
    "business_administration": "工商管理",
    "chinese_language_and_literature": "中国语言文学",
    "civil_servant": "公务员",
    "clinical_medicine": "临床医学",
    "college_chemistry": "大学化学",
    "college_economics": "大学经济学",
    "college_physics": "大学物理",
    "college_programming": "大学编程",
    "computer_architecture": "计算机组成",
    "computer_network": "计算机网络",
    "discrete_mathematics": "离散数学",
    "education_science": "教育学",
    "electrical_engineer": "注册电气工程师",
    "environmental_impact_assessment_engineer": "环境影响评价工程师",
    "fire_engineer": "注册消防工程师",
    "high_school_biology": "高中生物",
    "high_school_chemistry": "高中化学",
    "high_school_chinese": "高中语文",
    "high_school_geography": "高中地理",
    "high_school_history": "高中历史",
    "high_school_mathematics": "高中数学",
    "high_school_physics": "高中物理",
    "high_school_politics": "高中政治",
    "ideological_and_moral_cultivation": "思想道德修养与法律基础",
    "law": "法学",
    "legal_professional": "法律职业资格",
    "logic": "逻辑学",
    "mao_zedong_thought": "毛泽东思想和中国特色社会主义理论体系概论",
    "marxism": "马克思主义基本原理",
    "metrology_engineer": "注册计量师",
    "middle_school_biology": "初中生物",
    "middle_school_chemistry": "初中化学",
    "middle_school_geography": "初中地理",
    "middle_school_history": "初中历史",
    "middle_school_mathematics": "初中数学",
    "middle_school_physics": "初中物理",
    "middle_school_politics": "初中政治",
    "modern_chinese_history": "近代史纲要",
    "operating_system": "操作系统",
    "physician": "医师资格",
    "plant_protection": "植物保护",
    "probability_and_statistics": "概率统计",
    "professional_tour_guide": "导游资格",
    "sports_science": "体育学",
    "tax_accountant": "税务师",
    "teacher_qualification": "教师资格",
    "urban_and_rural_planner": "注册城乡规划师",
    "veterinary_medicine": "兽医学",
}


def doc_to_text(question: str, options: list) -> str:
    """The harness's C-Eval ``doc_to_text``."""
    return question.strip() + "".join(f"\n{c}. {o}" for c, o in zip(CHOICES, options)) + "\n答案："


def description(subject: str, where: str) -> str:
    if subject not in SUBJECTS_ZH:
        raise MsllmError(f"{where}: unknown C-Eval subject {subject!r} (the file name must be one of the 52 "
                         f"subjects, e.g. computer_network_val.csv)")
    return f"以下是中国关于{SUBJECTS_ZH[subject]}的单项选择题，请选出其中的正确答案。\n\n"


def read_split(path: str) -> list[tuple[str, list, int, str]]:
    """(question, options, gold index, file:line) for every row of one C-Eval CSV file."""
    out = []
    for line, row in read_csv(path, len(HEADER), header=HEADER):
        where = f"{path}:{line}"
        out.append((row[1], row[2:6], letter_index(row[6], 4, where), where))
    return out


def load(data_dir: str, num_fewshot: Optional[int] = None, limit: Optional[int] = None) -> TaskData:
    """All subjects' ``val`` questions with prompts; ``limit``: first N per subject.
    Errors as :func:`msllm.eval.tasks.mmlu.load`, and an unknown subject name."""
    k = 0 if num_fewshot is None else num_fewshot
    docs, files = load_subject_csvs(data_dir, "C-Eval", "val", k, limit, read_split=read_split,
                                    description=description, doc_to_text=doc_to_text, choices=CHOICES)
    return TaskData("ceval", "mc", docs, ("acc", "acc_norm"), k, per_subject=True, files=files)
