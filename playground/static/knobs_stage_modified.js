(choice, note) => {
  if (!window.dpStageEdit) return note;
  window.dpStageEdit = false;
  return (__MODIFIED__)(choice);
}
