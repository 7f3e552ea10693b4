(token) => {
  if (!token) return "";
  const url = new URL(window.location.href);
  url.hash = "";
  url.searchParams.set(__SHARE_PARAM__, token);
  const link = url.toString();
  const fallback = () => {
    const area = document.createElement("textarea");
    area.value = link; area.style.position = "fixed"; area.style.opacity = "0";
    document.body.appendChild(area); area.select();
    try { document.execCommand("copy"); } catch (e) {}
    area.remove();
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(link).catch(fallback);
  } else {
    fallback();
  }
  return link;
}
