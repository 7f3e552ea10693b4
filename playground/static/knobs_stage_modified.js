(choice, note) => {
  if (!window.dp?.stageEdit) return note;
  window.dp.stageEdit = false;
  return (__MODIFIED__)(choice);
}
