"""Every relative link in the Markdown documentation resolves.

Checks README.md, CHANGELOG.md, docs/**/*.md and bindings/*/README.md (the files given as data): a link to a file
must name one of the checked files or a file under docs/ (the files this test carries), and a link with
#fragment must name a heading of its Markdown target (GitHub's anchors). Links in code are not links.
"""
import os
import re
import sys
import tempfile
import unittest

LINK = re.compile(r'!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+"[^"]*")?\)')
CODE = re.compile(r'```.*?```|`[^`\n]*`', re.S)


def anchors(markdown):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen, out = {}, set()
    for heading in re.findall(r'^#{1,6}\s+(.*?)\s*#*\s*$', CODE.sub(lambda m: m.group(0).strip('`'), re.sub(
            r'```.*?```', '', markdown, flags=re.S)), re.M):
        heading = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # a link's text only
        slug = re.sub(r'[^\w\- ]', '', heading.lower()).replace(' ', '-')
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else '%s-%d' % (slug, n))
    return out


def broken_links(root, files):
    """(file, link, why) for every relative link among files (paths relative to root) that does not resolve."""
    known = set(files)
    dirs = {os.path.dirname(f) for f in known}
    dirs |= {d for f in known for d in _parents(f)}
    problems = []
    for f in sorted(known):
        if not f.endswith('.md'):
            continue
        with open(os.path.join(root, f), encoding='utf-8') as fh:
            text = fh.read()
        for m in LINK.finditer(CODE.sub('', text)):
            link = m.group(1)
            if re.match(r'[a-zA-Z][a-zA-Z+.-]*:', link):
                continue  # http:, https:, mailto:
            path, _, fragment = link.partition('#')
            target = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if target not in known and target.rstrip('/') not in dirs:
                problems.append((f, link, 'no such file among the checked ones: ' + target))
                continue
            if fragment:
                if not target.endswith('.md'):
                    problems.append((f, link, 'a #fragment on a file that is not Markdown'))
                    continue
                with open(os.path.join(root, target), encoding='utf-8') as fh:
                    if fragment not in anchors(fh.read()):
                        problems.append((f, link, "no heading '#%s' in %s" % (fragment, target)))
    return problems


def _parents(path):
    while True:
        path = os.path.dirname(path)
        if not path:
            return
        yield path


class LinksTest(unittest.TestCase):

    def test_documentation_links_resolve(self):
        root = os.environ.get('TEST_SRCDIR')
        root = os.path.join(root, os.environ.get('TEST_WORKSPACE', '__main__')) if root else os.getcwd()
        files = [os.path.normpath(f) for f in sys.argv[1:] if os.path.isfile(os.path.join(root, f))]
        self.assertIn('README.md', files)
        self.assertTrue(any(f.startswith('docs/') and f.endswith('.md') for f in files))
        problems = broken_links(root, files)
        self.assertEqual([], problems, '\n'.join('%s: (%s): %s' % p for p in problems))

    def test_a_broken_link_or_anchor_fails(self):
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, 'docs'))
            with open(os.path.join(root, 'docs/a.md'), 'w') as fh:
                fh.write('# A page\n\n## Its `second` part, too\n\n[ok](#its-second-part-too) [ok](../README.md)\n'
                         '[missing](gone.md) [bad anchor](../README.md#nowhere) `[code](not-a-link.md)`\n')
            with open(os.path.join(root, 'README.md'), 'w') as fh:
                fh.write('# Top\n\n[page](docs/a.md#a-page) [dir](docs/) ![img](docs/missing.svg)\n')
            problems = broken_links(root, ['README.md', 'docs/a.md'])
            self.assertEqual([('README.md', 'docs/missing.svg'), ('docs/a.md', 'gone.md'),
                              ('docs/a.md', '../README.md#nowhere')], [p[:2] for p in problems])


if __name__ == '__main__':
    unittest.main(argv=sys.argv[:1])
